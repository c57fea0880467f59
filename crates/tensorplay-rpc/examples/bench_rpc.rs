//! RPC latency and throughput between two workers on 127.0.0.1, measured the way PyTorch's
//! anchor `../shared/anchors/torch_rpc_latency.py` (TensorPipe) measures them, and printed in
//! the same line shapes, so `cargo xtask bench-rpc` can put the two side by side.
//!
//! Usage: `cargo run --release -p tensorplay-rpc --example bench_rpc [max_mib] [parts]`
//! (`parts`: a comma-separated subset of `sync,async,echo,remote`; all by default).
//!
//! Rank 0 calls rank 1:
//! - `rpc_sync` of a no-op with a small argument, 2000 calls, the first 200 skipped (p50, p99);
//! - 5000 `rpc_async` no-op calls in flight at once (calls per second);
//! - an echo of a 1, 16 and 64 MiB f32 tensor, 2 warm-up calls then 10 timed (GB/s counts the
//!   bytes both ways);
//! - `remote` + `to_here` of a no-op, 500 pairs, the first 50 skipped (p50).

use std::time::{Duration, Instant};

use clap::Parser;
use tensorplay_core::{DType, Tensor};
use tensorplay_rpc as rpc;

type R = Result<(), Box<dyn std::error::Error + Send + Sync>>;

fn pct(sorted: &[f64], q: f64) -> f64 {
    sorted[((sorted.len() as f64 * q) as usize).min(sorted.len() - 1)]
}

fn median(sorted: &[f64]) -> f64 {
    let n = sorted.len();
    if n % 2 == 1 {
        sorted[n / 2]
    } else {
        (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0
    }
}

fn run(rank: usize, max_mib: usize, parts: &str, out: &mut String) -> R {
    let part = |p: &str| parts.split(',').any(|q| q == p || q == "all");
    rpc::register("noop", |x: i64| Ok(x));
    rpc::register("echo", |t: Tensor| Ok(t));
    rpc::init_rpc(
        &format!("worker{rank}"),
        rank,
        2,
        rpc::RpcBackendOptions {
            rpc_timeout: Duration::from_secs(120),
            ..Default::default()
        },
    )?;
    if rank == 0 && part("sync") {
        let mut lat = Vec::with_capacity(2000);
        for i in 0..2000i64 {
            let t = Instant::now();
            let _: i64 = rpc::rpc_sync("worker1", "noop", i, None)?;
            lat.push(t.elapsed().as_secs_f64());
        }
        let mut lat = lat.split_off(200);
        lat.sort_by(f64::total_cmp);
        out.push_str(&format!(
            "tensorplay-rpc rpc_sync small  p50 {:8.1} us  p99 {:8.1} us\n",
            median(&lat) * 1e6,
            pct(&lat, 0.99) * 1e6
        ));
    }
    if rank == 0 && part("async") {
        let t = Instant::now();
        let futs = (0..5000i64)
            .map(|i| rpc::rpc_async::<i64, i64>("worker1", "noop", i, None))
            .collect::<Result<Vec<_>, _>>()?;
        for f in futs {
            f.wait()?;
        }
        let dt = t.elapsed().as_secs_f64();
        out.push_str(&format!(
            "tensorplay-rpc rpc_async small  {:10.0} calls/s (5000 in flight)\n",
            5000.0 / dt
        ));
    }
    if rank == 0 && part("echo") {
        for mib in [1usize, 16, 64].into_iter().filter(|&m| m <= max_mib) {
            let x = Tensor::ones(&[mib << 18], DType::F32)?;
            for _ in 0..2 {
                let _: Tensor = rpc::rpc_sync("worker1", "echo", x.clone(), None)?;
            }
            let n = 10;
            let t = Instant::now();
            for _ in 0..n {
                let y: Tensor = rpc::rpc_sync("worker1", "echo", x.clone(), None)?;
                assert_eq!(y.numel(), mib << 18);
            }
            let dt = t.elapsed().as_secs_f64() / f64::from(n);
            out.push_str(&format!(
                "tensorplay-rpc echo {mib:3} MiB  {:8.2} ms/round trip  {:7.3} GB/s\n",
                dt * 1e3,
                2.0 * (mib << 20) as f64 / dt / 1e9
            ));
        }
    }
    if rank == 0 && part("remote") {
        let mut lat = Vec::with_capacity(500);
        for i in 0..500i64 {
            let t = Instant::now();
            let r: rpc::RRef<i64> = rpc::remote("worker1", "noop", i, None)?;
            let _ = r.to_here(None)?;
            lat.push(t.elapsed().as_secs_f64());
        }
        let mut lat = lat.split_off(50);
        lat.sort_by(f64::total_cmp);
        out.push_str(&format!(
            "tensorplay-rpc remote+to_here   p50 {:8.1} us\n",
            median(&lat) * 1e6
        ));
    }
    rpc::shutdown(true)?;
    Ok(())
}

fn report_path() -> std::path::PathBuf {
    let parent =
        std::env::var("TENSORPLAY_BENCH_PARENT").unwrap_or_else(|_| std::process::id().to_string());
    std::env::temp_dir().join(format!("tensorplay-bench-rpc-{parent}.txt"))
}

/// RPC latency and throughput between two workers on this machine.
#[derive(Parser, Debug)]
#[command(
    name = "bench_rpc",
    about = "RPC latency and throughput between two workers on 127.0.0.1, in the lines of \
             PyTorch's anchor torch_rpc_latency.py (`cargo xtask bench-rpc` reads them)."
)]
struct Args {
    /// The largest echoed tensor, in MiB (of 1, 16 and 64).
    #[arg(default_value_t = 64)]
    max_mib: usize,
    /// Which measurements: a comma-separated subset of sync,async,echo,remote, or all.
    #[arg(default_value = "all", value_parser = parse_parts)]
    parts: String,
}

/// `parts`: names from `sync,async,echo,remote,all`, comma-separated.
fn parse_parts(v: &str) -> Result<String, String> {
    const NAMES: [&str; 5] = ["sync", "async", "echo", "remote", "all"];
    match v.split(',').find(|p| !NAMES.contains(p)) {
        Some(p) => Err(format!("{p:?} is not one of {}", NAMES.join(","))),
        None => Ok(v.to_string()),
    }
}

fn main() -> R {
    let Args { max_mib, parts } = Args::parse();
    tensorplay_core::set_num_threads(1);
    let parent = std::process::id().to_string();
    let report = std::env::temp_dir().join(format!("tensorplay-bench-rpc-{parent}.txt"));
    let _ = std::fs::remove_file(&report);
    let mut opts = tensorplay_collectives::SpawnOptions::new(2);
    opts.timeout = Some(Duration::from_secs(900));
    opts.env.push(("TENSORPLAY_BENCH_PARENT".into(), parent));
    let r = tensorplay_collectives::spawn::spawn_with(opts, move |rank| {
        let mut out = String::new();
        let r = run(rank, max_mib, &parts, &mut out);
        if rank == 0 {
            // the children's output is captured by spawn: rank 0 reports through a file
            std::fs::write(report_path(), &out)?;
        }
        r
    });
    if let Ok(text) = std::fs::read_to_string(&report) {
        print!("{text}");
    }
    let _ = std::fs::remove_file(&report);
    r?;
    Ok(())
}
