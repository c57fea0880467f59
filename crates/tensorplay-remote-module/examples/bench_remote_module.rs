//! RemoteModule forward latency between two workers on 127.0.0.1, measured as PyTorch's anchor
//! `../shared/anchors/torch_rpc_latency.py` measures it (a `Linear(16, 8)` on worker1, input
//! `[4, 16]`, 50 warm-up calls, then 1000 timed; p50), and printed in the same line shape, so
//! `cargo xtask bench-rpc` can put the two side by side.
//!
//! Usage: `cargo run --release -p tensorplay-distributed-nn --example bench_remote_module`.

use std::time::{Duration, Instant};

use tensorplay_core::nn::Linear;
use tensorplay_remote_module::{LinearArgs, RemoteModule, register_module};
use tensorplay_rpc as rpc;

type R = Result<(), Box<dyn std::error::Error + Send + Sync>>;

fn run(rank: usize) -> Result<String, Box<dyn std::error::Error + Send + Sync>> {
    register_module::<Linear>();
    rpc::init_rpc(&format!("worker{rank}"), rank, 2, Default::default())?;
    let mut out = String::new();
    if rank == 0 {
        let rm = RemoteModule::<Linear>::new(
            "worker1/cpu",
            LinearArgs {
                in_features: 16,
                out_features: 8,
                bias: true,
            },
        )?;
        let x = tensorplay_core::randn(&[4, 16])?;
        for _ in 0..50 {
            rm.forward(&x)?;
        }
        let mut lat = Vec::with_capacity(1000);
        for _ in 0..1000 {
            let t = Instant::now();
            rm.forward(&x)?;
            lat.push(t.elapsed().as_secs_f64());
        }
        lat.sort_by(f64::total_cmp);
        let p50 = (lat[499] + lat[500]) / 2.0;
        out.push_str(&format!(
            "tensorplay-rpc RemoteModule Linear(16,8) forward  p50 {:8.1} us\n",
            p50 * 1e6
        ));
    }
    rpc::shutdown(true)?;
    Ok(out)
}

fn main() -> R {
    tensorplay_core::set_num_threads(1);
    let parent = std::process::id().to_string();
    let report = std::env::temp_dir().join(format!("tensorplay-bench-rm-{parent}.txt"));
    let _ = std::fs::remove_file(&report);
    let mut opts = tensorplay_collectives::SpawnOptions::new(2);
    opts.timeout = Some(Duration::from_secs(300));
    opts.env.push(("TENSORPLAY_BENCH_PARENT".into(), parent));
    let r = tensorplay_collectives::spawn::spawn_with(opts, |rank| {
        let out = run(rank)?;
        if rank == 0 {
            // the children's output is captured by spawn: rank 0 reports through a file
            let parent = std::env::var("TENSORPLAY_BENCH_PARENT")?;
            std::fs::write(
                std::env::temp_dir().join(format!("tensorplay-bench-rm-{parent}.txt")),
                out,
            )?;
        }
        Ok::<(), Box<dyn std::error::Error + Send + Sync>>(())
    });
    if let Ok(text) = std::fs::read_to_string(&report) {
        print!("{text}");
    }
    let _ = std::fs::remove_file(&report);
    r?;
    Ok(())
}
