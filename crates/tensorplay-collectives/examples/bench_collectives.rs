//! Collective bandwidth of the "cpu" backend on this machine, with nccl-tests conventions and
//! the byte accounting of PyTorch's `torch_gloo_collectives.py` anchor, so the two can be
//! compared line by line (`cargo xtask bench-collectives` runs both).
//!
//! Usage: `cargo run --release -p tensorplay-collectives --example bench_collectives [world] [max_mib]`
//! (or one process per rank under `tensorplay-run`, which `cargo xtask bench-collectives
//! --hosts 2` does on simulated hosts).
//!
//! The size is the per-rank tensor for all_reduce and broadcast, and the whole gathered output
//! (world x per-rank chunk) for all_gather and the whole input for reduce_scatter;
//! algbw = size / time; busbw = algbw * 2(n-1)/n for all_reduce, algbw * (n-1)/n for
//! all_gather and reduce_scatter, algbw for broadcast.
//!
//! Last, `all_reduce_bf16`: the all_reduce of a bfloat16 tensor at 16 MiB (or the largest size
//! when that is smaller), its bytes those of the bfloat16 elements moved (the cpu backend sums
//! in float32 and rounds once), beside float32's line of the same size.

use std::time::{Duration, Instant};

use clap::Parser;
use tensorplay_collectives::{self as dist, InitOptions, ReduceOp};
use tensorplay_core::{DType, Tensor};

type R = Result<(), Box<dyn std::error::Error + Send + Sync>>;

fn run(rank: usize, world: usize, max_mib: usize) -> R {
    dist::init_process_group(
        "cpu",
        InitOptions {
            timeout: Duration::from_secs(120),
            ..Default::default()
        },
    )?;
    let mut sizes = vec![4usize << 10];
    while *sizes.last().unwrap_or(&0) < (max_mib << 20) {
        let next = sizes.last().copied().unwrap_or(0) * 4;
        sizes.push(next);
    }
    let bf16_size = (16usize << 20).min(*sizes.last().unwrap_or(&0));
    let rows = ["all_reduce", "broadcast", "all_gather", "reduce_scatter"]
        .into_iter()
        .flat_map(|name| sizes.iter().map(move |&b| (name, b)))
        .chain([("all_reduce_bf16", bf16_size)]);
    for (name, nbytes) in rows {
        let (dtype, width) = if name == "all_reduce_bf16" {
            (DType::BF16, 2)
        } else {
            (DType::F32, 4)
        };
        let n = if matches!(name, "all_reduce" | "all_reduce_bf16" | "broadcast") {
            nbytes / width
        } else {
            nbytes / width / world
        };
        let x = Tensor::ones(&[n], dtype)?;
        let big = Tensor::ones(&[n * world], dtype)?;
        let op = || -> dist::Result<()> {
            match name {
                "all_reduce" | "all_reduce_bf16" => dist::all_reduce(&x, ReduceOp::Sum, None),
                "broadcast" => dist::broadcast(&x, 0, None),
                "all_gather" => dist::all_gather_into_tensor(&big, &x, None),
                _ => dist::reduce_scatter_tensor(&x, &big, ReduceOp::Sum, None),
            }
        };
        // TENSORPLAY_BENCH_ITERS overrides the count (for latency comparisons)
        let iters = std::env::var("TENSORPLAY_BENCH_ITERS")
            .ok()
            .and_then(|v| v.parse::<u32>().ok())
            .unwrap_or_else(|| (((64usize << 20) / nbytes).clamp(3, 200)) as u32);
        for _ in 0..2 {
            op()?;
        }
        dist::barrier(None)?;
        let t = Instant::now();
        for _ in 0..iters {
            op()?;
        }
        dist::barrier(None)?;
        let dt = t.elapsed().as_secs_f64() / iters as f64;
        let algbw = nbytes as f64 / dt / 1e9;
        let f = match name {
            "all_reduce" | "all_reduce_bf16" => 2.0 * (world - 1) as f64 / world as f64,
            "broadcast" => 1.0,
            _ => (world - 1) as f64 / world as f64,
        };
        if rank == 0 {
            // the children's output is captured by spawn: rank 0 reports through a file;
            // under tensorplay-run (several hosts: `cargo xtask bench-collectives
            // --hosts 2`) it prints the line, which the launcher forwards
            let line = format!(
                "tensorplay-cpu {name:15} {nbytes:>10} B  {:10.2} us  algbw {algbw:7.3} GB/s  busbw {:7.3} GB/s\n",
                dt * 1e6,
                algbw * f
            );
            if std::env::var_os("TENSORPLAY_RUN").is_some_and(|v| v == "1") {
                print!("{line}");
                continue;
            }
            use std::io::Write;
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(report_path())?
                .write_all(line.as_bytes())?;
        }
    }
    dist::destroy_process_group()?;
    Ok(())
}

fn report_path() -> std::path::PathBuf {
    let parent =
        std::env::var("TENSORPLAY_BENCH_PARENT").unwrap_or_else(|_| std::process::id().to_string());
    std::env::temp_dir().join(format!("tensorplay-bench-collectives-{parent}.txt"))
}

/// Collective bandwidth of the "cpu" backend, in the lines of nccl-tests.
#[derive(Parser, Debug)]
#[command(
    name = "bench_collectives",
    about = "Bus bandwidth of all_reduce, all_gather, reduce_scatter and broadcast on the \"cpu\" \
             backend, in nccl-tests' conventions (the lines `cargo xtask bench-collectives` reads)."
)]
struct Args {
    /// Ranks (processes) on this machine.
    #[arg(default_value_t = 2, value_parser = at_least_one)]
    world: usize,
    /// The largest size, in MiB (sizes double from 4 KiB up to it).
    #[arg(default_value_t = 64)]
    max_mib: usize,
}

/// A whole number >= 1.
fn at_least_one(v: &str) -> Result<usize, String> {
    match v.parse::<usize>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err("expected a whole number >= 1".into()),
    }
}

fn main() -> R {
    let args = Args::parse();
    let (world, max_mib) = (args.world, args.max_mib);
    tensorplay_core::set_num_threads(1);
    let parent = std::process::id().to_string();
    let report = std::env::temp_dir().join(format!("tensorplay-bench-collectives-{parent}.txt"));
    let _ = std::fs::remove_file(&report);
    let mut opts = dist::SpawnOptions::new(world);
    opts.timeout = Some(Duration::from_secs(1800));
    opts.env.push(("TENSORPLAY_BENCH_PARENT".into(), parent));
    let r = dist::spawn::spawn_with(opts, move |rank| run(rank, world, max_mib));
    if let Ok(text) = std::fs::read_to_string(&report) {
        print!("{text}");
    }
    let _ = std::fs::remove_file(&report);
    r?;
    Ok(())
}
