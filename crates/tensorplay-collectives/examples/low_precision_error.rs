//! The error of the cpu backend's 16-bit all_reduce (SUM) against the float64 sum, with the
//! inputs of `benchmarks/gloo_bf16_error.py` (PyTorch gloo's measurement), so the two tables of
//! docs/collectives.md compare line by line.
//!
//! Usage: `cargo run --release -p tensorplay-collectives --example low_precision_error [n]`;
//! the transport follows the environment as in any job: `TENSORPLAY_SHM=0` sends over TCP,
//! and there `TENSORPLAY_RING_16BIT=hop` rounds at each hop (the default sends float32 partial
//! sums). For worlds 2 to 4 and bfloat16 and float16 it prints `world dtype differs
//! max_err/(u sum|x|) time_ms`: the share of elements not equal to the float64 sum rounded
//! once, the largest error in units of `u * sum_i |x_i|` (`u`: 2^-8 for bfloat16, 2^-11 for
//! float16; a result rounded once is at most 1.0), and the time of one all_reduce.

use std::io::Write;
use std::time::{Duration, Instant};

use tensorplay_collectives::{self as dist, InitOptions, ReduceOp};
use tensorplay_core::{DType, Tensor};

type R = Result<(), Box<dyn std::error::Error + Send + Sync>>;

/// Rank `r`'s inputs in [-1, 1) (the anchor's hash), as float64.
fn inputs(r: usize, n: usize) -> Vec<f64> {
    (0..n as u64)
        .map(|i| {
            let h = (i * 2_654_435_761 + (r as u64 + 1) * 40_503 * 97 + 12_345) % (1 << 32);
            h as f64 / 2f64.powi(32) * 2.0 - 1.0
        })
        .collect()
}

fn report_path() -> std::path::PathBuf {
    let parent = std::env::var("TENSORPLAY_ERROR_PARENT").unwrap_or_default();
    std::env::temp_dir().join(format!("tensorplay-low-precision-error-{parent}.txt"))
}

fn run(rank: usize, world: usize, n: usize) -> R {
    dist::init_process_group(
        "cpu",
        InitOptions {
            timeout: Duration::from_secs(120),
            ..Default::default()
        },
    )?;
    for dtype in [DType::BF16, DType::F16] {
        // every rank's inputs rounded to the dtype, as float64 values
        let xs: Vec<Vec<f64>> = (0..world)
            .map(|r| {
                Tensor::from_vec(inputs(r, n), &[n])?
                    .to_dtype(dtype)?
                    .to_vec_f64()
            })
            .collect::<tensorplay_core::Result<_>>()?;
        let t = Tensor::from_vec(xs[rank].clone(), &[n])?.to_dtype(dtype)?;
        dist::barrier(None)?;
        let start = Instant::now();
        dist::all_reduce(&t, ReduceOp::Sum, None)?;
        let ms = start.elapsed().as_secs_f64() * 1e3;
        if rank != 0 {
            continue;
        }
        let got = t.to_vec_f64()?;
        let exact: Vec<f64> = (0..n).map(|i| xs.iter().map(|x| x[i]).sum()).collect();
        let once = Tensor::from_vec(exact.clone(), &[n])?
            .to_dtype(dtype)?
            .to_vec_f64()?;
        let u = if dtype == DType::BF16 {
            2f64.powi(-8)
        } else {
            2f64.powi(-11)
        };
        let mut differs = 0usize;
        let mut worst = 0.0f64;
        for i in 0..n {
            if got[i] != once[i] {
                differs += 1;
            }
            let mag: f64 = xs.iter().map(|x| x[i].abs()).sum();
            if mag > 0.0 {
                worst = worst.max((got[i] - exact[i]).abs() / (u * mag));
            }
        }
        let line = format!(
            "{world} {dtype} {:.2}% {worst:.2} {ms:.1}\n",
            100.0 * differs as f64 / n as f64
        );
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(report_path())?
            .write_all(line.as_bytes())?;
    }
    dist::barrier(None)?;
    dist::destroy_process_group()?;
    Ok(())
}

/// The 16-bit all_reduce's error against the float64 sum (see the file's docs).
#[derive(clap::Parser, Debug)]
#[command(name = "low_precision_error")]
struct Args {
    /// Elements per rank.
    #[arg(default_value_t = 1 << 20)]
    n: usize,
}

fn main() -> R {
    let n = <Args as clap::Parser>::parse().n;
    tensorplay_core::set_num_threads(1);
    // the children run this again (spawn re-executes the program): only the parent names the
    // report file, clears it and prints
    let parent = std::env::var_os(dist::spawn::SPAWN_RANK_ENV).is_none();
    if parent {
        // SAFETY: single-threaded here, before any rank starts
        unsafe { std::env::set_var("TENSORPLAY_ERROR_PARENT", std::process::id().to_string()) };
        let _ = std::fs::remove_file(report_path());
        println!("world dtype differs max_err/(u sum|x|) time_ms");
    }
    for world in 2..=4 {
        let mut opts = dist::SpawnOptions::new(world);
        opts.timeout = Some(Duration::from_secs(600));
        dist::spawn::spawn_with(opts, move |rank| run(rank, world, n))?;
    }
    if let Ok(text) = std::fs::read_to_string(report_path()) {
        print!("{text}");
    }
    let _ = std::fs::remove_file(report_path());
    Ok(())
}
