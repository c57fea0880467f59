//! `tensorplay-gpu-check`: the GPU path of this machine, checked in a few minutes by a prebuilt
//! binary (`cargo xtask gpu-check --bundle DIR` packs it with a `run.sh`).
//!
//! It checks, on `cuda:0`: the kernels compile and load; every core operation and its gradient
//! against the CPU (`ops.rs`); the fused optimizers, an MLP's gradients, the wine_quality
//! example with `--device cuda`, the product description's first example on `"nccl"` and a
//! RemoteModule on `"worker1/cuda:0"` (`training.rs`); NCCL at world size 1 for every
//! collective, dtype and op, the NCCL timeout path, CUDA copies and RPC of a CUDA tensor
//! (`collectives.rs`). Ends with `N passed, M failed, K skipped`, then (unless `--no-bench`)
//! the core benchmark's GPU rows beside PyTorch's (`bench.rs`). Exits 0 only when nothing
//! failed. Without a GPU or driver it says why and exits 2: it never reports checks as passed
//! that did not run.
//!
//! Options: `--no-bench`; `--python PATH` (the interpreter with PyTorch for the benchmark's
//! other side; default `python3`).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use tensorplay as tp;
use tp::distributed as dist;
use tp::{DType, Tensor};

mod bench;
mod collectives;
mod half;
mod ops;
mod training;

type Res = Result<(), String>;

/// The GPU check's command line.
#[derive(Parser, Debug)]
#[command(
    name = "tensorplay-gpu-check",
    version,
    about = "Checks this machine's GPU path of tensorplay on cuda:0 (kernels, every core \
             operation and gradient against the CPU, the fused optimizers, wine_quality --device \
             cuda, NCCL and RPC of CUDA tensors), then shows the core benchmark's GPU rows beside \
             PyTorch's. Exits 0 only when nothing failed, 2 without a GPU or driver."
)]
struct Args {
    /// Skip the benchmark after the checks.
    #[arg(long)]
    no_bench: bool,
    /// The Python interpreter with PyTorch, for the benchmark's other side.
    #[arg(long, value_name = "PATH", default_value = "python3")]
    python: String,
}

fn e(x: impl std::fmt::Display) -> String {
    x.to_string()
}

/// `n` small values that are exact in every dtype.
fn input(dt: DType, n: usize) -> Result<Tensor, String> {
    let v: Vec<f64> = (0..n).map(|i| (i % 3) as f64).collect();
    Tensor::from_vec(v, &[n])
        .and_then(|t| t.to_dtype(dt))
        .map_err(e)
}

fn same(what: &str, got: &Tensor, want: &Tensor) -> Res {
    let (g, w) = (got.cpu().map_err(e)?, want.cpu().map_err(e)?);
    let (g, w) = (g.to_vec_f64().map_err(e)?, w.to_vec_f64().map_err(e)?);
    if g != w {
        return Err(format!("{what}: got {g:?}, want {w:?}"));
    }
    Ok(())
}

const CHILD: &str = "TENSORPLAY_GPU_CHECK_CHILD";

/// The multi-process checks: name, the `CHILD` value that selects it, world size.
const SPAWNED: [(&str, &str, usize); 5] = [
    ("nccl world 1: every collective, dtype and op", "nccl", 1),
    (
        "nccl timeout: a communicator whose second rank never joins",
        "timeout",
        2,
    ),
    ("rpc of a cuda tensor with a device map", "rpc", 2),
    (
        "the first example on nccl: a differentiable all_reduce of a cuda tensor, backward",
        "first",
        1,
    ),
    (
        "a RemoteModule on worker1/cuda:0 trained against worker1/cpu",
        "remote",
        2,
    ),
];

fn spawned(which: &str, world: usize) -> Res {
    let opts = dist::SpawnOptions {
        // the children route themselves to this call (the first `spawn` they reach, from
        // `main`), whichever check of the list it is
        env: vec![
            (CHILD.into(), which.into()),
            (dist::SPAWN_CALLS_ENV.into(), "0".into()),
        ],
        timeout: Some(Duration::from_secs(120)),
        ..dist::SpawnOptions::new(world)
    };
    let which = which.to_string();
    dist::spawn_with(opts, move |rank| {
        let r = match which.as_str() {
            "nccl" => collectives::nccl_world_one(),
            "timeout" => collectives::nccl_timeout(rank),
            "first" => training::first_example_nccl(),
            "remote" => training::remote_module_cuda(rank),
            _ => collectives::rpc_cuda(rank),
        };
        r.map_err(|m| format!("rank {rank}: {m}").into())
    })
    .map_err(e)
}

fn main() -> ExitCode {
    // (the ranks of the multi-process checks are run with the same arguments)
    let args = Args::parse();
    if let Ok(which) = std::env::var(CHILD) {
        // a rank of one of the multi-process checks: spawn re-ran this binary, and the same
        // spawn call runs the check for this rank and exits
        let world = SPAWNED.iter().find(|s| s.1 == which).map_or(1, |s| s.2);
        return match spawned(&which, world) {
            Ok(()) => ExitCode::SUCCESS,
            Err(m) => {
                eprintln!("{m}");
                ExitCode::FAILURE
            }
        };
    }
    if !tp::cuda::is_driver_present() {
        eprintln!("gpu-check: no CUDA driver (libcuda.so) on this machine; nothing was checked");
        return ExitCode::from(2);
    }
    if tp::cuda::device_count() == 0 {
        eprintln!("gpu-check: the CUDA driver found no GPU; nothing was checked");
        return ExitCode::from(2);
    }
    let (mut passed, mut failed, mut skipped) = (0, 0, 0);
    let mut report = |name: &str, r: Res| match r {
        Ok(()) => {
            passed += 1;
            println!("ok      {name}");
        }
        Err(msg) => {
            failed += 1;
            println!("FAILED  {name}: {msg}");
        }
    };
    report(
        "cuda kernels compile (NVRTC) and load",
        tp::cuda::load_kernels(0)
            .map(|what| println!("        {what}"))
            .map_err(e),
    );
    report(
        "every core operation and its gradient against the CPU: elementwise",
        ops::elementwise(),
    );
    report(
        "every core operation and its gradient against the CPU: reductions, products, indexing, losses",
        ops::reductions_and_products(),
    );
    report("in-place writes and dropout", ops::inplace_and_dropout());
    report(
        "bfloat16 and float16: casts, ops, cross-entropy and GemmEx products against the CPU",
        half::sixteen_bit(),
    );
    report(
        "SGD, Adam, AdamW fused updates against the CPU",
        training::optimizers(),
    );
    report(
        "an MLP's loss and gradients against the CPU",
        training::mlp_gradients(),
    );
    let here = std::env::current_exe()
        .ok()
        .and_then(|p| p.parent().map(PathBuf::from))
        .unwrap_or_default();
    let wine = here.join("wine_quality");
    if wine.exists() {
        report(
            "wine_quality --device cuda: the CPU's accuracy within 0.01",
            training::wine_quality(&wine),
        );
    } else {
        skipped += 1;
        println!(
            "skipped wine_quality --device cuda: {} is not in the bundle",
            wine.display()
        );
    }
    report(
        "nccl library",
        tensorplay_nccl::library().map(|p| println!("        {p}")),
    );
    report(
        "cuda copies of every dtype",
        (|| {
            for dt in [DType::F32, DType::F64, DType::I64, DType::Bool, DType::F16] {
                let x = input(dt, 4097)?;
                same(
                    &format!("{dt} to cuda:0 and back"),
                    &x.to("cuda:0").map_err(e)?,
                    &x,
                )?;
            }
            Ok(())
        })(),
    );
    for (name, which, world) in SPAWNED {
        report(name, spawned(which, world));
    }
    println!("{passed} passed, {failed} failed, {skipped} skipped");
    if !args.no_bench
        && let Err(why) = bench::run(&args.python, &here.join("torch_cuda_step.py"))
    {
        println!("bench   not measured: {why}");
    }
    if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
