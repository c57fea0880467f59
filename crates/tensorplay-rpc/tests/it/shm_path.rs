//! Large tensors between two workers of this host take the shared-memory path, arrive intact
//! both ways, and leave nothing behind in /dev/shm after shutdown.

use std::time::Duration;

use tensorplay_collectives::spawn::spawn;
use tensorplay_core::Tensor;
use tensorplay_rpc as rpc;

type TestResult = Result<(), Box<dyn std::error::Error + Send + Sync>>;

/// This process's shared-memory directories (`tensorplay-rpc-<pidns>-<pid>-<random>`).
fn my_shm_dirs() -> Vec<String> {
    let me = format!("-{}-", std::process::id());
    std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.file_name().into_string().ok())
                .filter(|n| n.starts_with("tensorplay-rpc-") && n.contains(&me))
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn large_tensors_through_shared_memory() -> TestResult {
    if !std::path::Path::new("/dev/shm").is_dir() {
        return Ok(()); // no shared memory on this system: QUIC only (the other tests)
    }
    spawn(2, |rank| -> TestResult {
        rpc::register("scale", |(x, k): (Tensor, f64)| x.mul_scalar(k));
        rpc::init_rpc(
            &format!("worker{rank}"),
            rank,
            2,
            rpc::RpcBackendOptions {
                rpc_timeout: Duration::from_secs(30),
                ..Default::default()
            },
        )?;
        let other = 1 - rank;
        // 1 MiB each way (over the threshold), a transposed view, several calls in flight
        let x = Tensor::from_vec(
            (0..262_144).map(|i| i as f32).collect::<Vec<f32>>(),
            &[512, 512],
        )?;
        let futs: Vec<_> = (0..4)
            .map(|k| {
                rpc::rpc_async::<(Tensor, f64), Tensor>(other, "scale", (x.t()?, k as f64), None)
                    .map_err(Into::into)
            })
            .collect::<Result<_, Box<dyn std::error::Error + Send + Sync>>>()?;
        for (k, f) in futs.into_iter().enumerate() {
            let y = f.wait()?;
            assert_eq!(y.shape(), &[512, 512]);
            assert_eq!(
                y.to_vec::<f32>()?,
                x.t()?.mul_scalar(k as f64)?.to_vec::<f32>()?
            );
        }
        let dirs = my_shm_dirs();
        assert_eq!(dirs.len(), 1, "one directory per worker: {dirs:?}");
        // our requests went through segments, given back by the callee before it answered
        // (a response to the peer's calls may still be in flight in another segment)
        let segments: Vec<String> = std::fs::read_dir(format!("/dev/shm/{}", dirs[0]))?
            .flatten()
            .filter_map(|e| e.file_name().into_string().ok())
            .filter(|n| n != "host")
            .collect();
        assert!(
            segments.iter().any(|n| n.ends_with(".free")),
            "{segments:?}"
        );
        rpc::shutdown(true)?;
        assert!(
            my_shm_dirs().is_empty(),
            "the directory is removed at shutdown"
        );
        Ok(())
    })?;
    Ok(())
}
