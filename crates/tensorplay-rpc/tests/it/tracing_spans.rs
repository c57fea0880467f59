//! Every call is a `tracing` span named `rpc` with the worker, the function, the bytes each
//! way and the latency; nothing is printed without a subscriber (quiet by default).

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tensorplay_collectives::spawn::spawn;
use tensorplay_core::Tensor;
use tensorplay_rpc as rpc;

type TestResult = Result<(), Box<dyn std::error::Error + Send + Sync>>;

/// A writer that keeps everything the subscriber prints.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().expect("lock").extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn calls_are_spans_with_worker_function_bytes_and_latency() -> TestResult {
    spawn(2, |rank| -> TestResult {
        let out = Captured::default();
        let sink = out.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::DEBUG)
            .with_ansi(false)
            .with_writer(move || sink.clone())
            .finish();
        tracing::subscriber::set_global_default(subscriber)?;
        rpc::register("echo", |t: Tensor| Ok(t));
        rpc::init_rpc(
            &format!("worker{rank}"),
            rank,
            2,
            rpc::RpcBackendOptions {
                rpc_timeout: Duration::from_secs(20),
                ..Default::default()
            },
        )?;
        if rank == 0 {
            // 1000 float32 values each way: 4000 bytes of tensor data plus the envelope
            let t = Tensor::from_vec(vec![1.0f32; 1000], &[1000])?;
            let back: Tensor = rpc::rpc_sync("worker1", "echo", t, None)?;
            assert_eq!(back.numel(), 1000);
        }
        rpc::shutdown(true)?;
        if rank == 0 {
            let text = String::from_utf8(out.0.lock().expect("lock").clone())?;
            let line = text
                .lines()
                .find(|l| l.contains("rpc done") && l.contains("function=rpc echo"))
                .ok_or_else(|| format!("no span of the echo call in:\n{text}"))?;
            assert!(line.contains("worker=worker1"), "{line}");
            let field = |name: &str| -> Option<u64> {
                let rest = line.split(&format!("{name}=")).nth(1)?;
                rest.split(|c: char| !c.is_ascii_digit())
                    .next()?
                    .parse()
                    .ok()
            };
            let sent = field("bytes_sent").ok_or_else(|| format!("no bytes_sent in {line}"))?;
            let received =
                field("bytes_received").ok_or_else(|| format!("no bytes_received in {line}"))?;
            assert!((4000..5000).contains(&sent), "{line}");
            assert!((4000..5000).contains(&received), "{line}");
            field("latency_us").ok_or_else(|| format!("no latency_us in {line}"))?;
        }
        Ok(())
    })?;
    Ok(())
}
