//! The backend contract with a backend that is not `"cpu"`: a test double registered with
//! `register_backend` (its own TCP mesh through the factory's store, dtypes float32 and
//! float64 only, every call recorded, one call made to fail naming a group rank). It shows
//! that the checks, the rank translation and the timeouts live above the trait: mismatches are
//! caught on every rank before the double sees a call, subgroup roots reach it as group ranks
//! and its errors reach users with global ranks, and a rank that skips a call is a timeout.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tensorplay_collectives::backend::{Backend, BackendContext, HostTensors, cpu::CpuBackend};
use tensorplay_collectives::{self as dist, InitOptions, ReduceOp};
use tensorplay_core::{DType, Device, Tensor};

use super::{TestResult, as_f64, check, reduce_ref, tensor, values};

/// What the double saw: `"op root=R n=N"` per call.
static LOG: Mutex<Vec<String>> = Mutex::new(Vec::new());

fn log(line: String) {
    LOG.lock().unwrap_or_else(|e| e.into_inner()).push(line);
}

fn calls() -> Vec<String> {
    LOG.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

/// The elements count that makes the double fail, blaming its group rank 1.
const POISON: usize = 13;
/// The elements count that makes the double panic (a backend bug).
const PANIC: usize = 17;

struct Recording {
    inner: HostTensors,
}

impl Recording {
    fn new(ctx: &BackendContext) -> dist::Result<Recording> {
        let host = CpuBackend::new(ctx.store.clone(), ctx.rank, ctx.size, ctx.timeout)?;
        Ok(Recording {
            inner: HostTensors::new("recording", Arc::new(host)),
        })
    }
}

impl Backend for Recording {
    fn name(&self) -> &str {
        "recording"
    }
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn size(&self) -> usize {
        self.inner.size()
    }
    fn device(&self) -> Device {
        Device::Cpu
    }
    fn dtypes(&self) -> &'static [DType] {
        &[DType::F32, DType::F64]
    }
    fn all_reduce(&self, t: &Tensor, op: ReduceOp, timeout: Duration) -> dist::Result<()> {
        log(format!("all_reduce n={}", t.numel()));
        if t.numel() == POISON {
            return Err(dist::Error::PeerFailed {
                rank: self.rank(),
                peer: 1,
                op: "all_reduce".into(),
                // the peer is a typed rank: the group renames it to its global rank
                detail: dist::detail!(
                    "rank ",
                    dist::Part::Rank(1),
                    " hung up (injected by the test double)"
                ),
            });
        }
        if t.numel() == PANIC {
            panic!("the test double panics on purpose");
        }
        self.inner.all_reduce(t, op, timeout)
    }
    fn broadcast(&self, t: &Tensor, root: usize, timeout: Duration) -> dist::Result<()> {
        log(format!("broadcast root={root} n={}", t.numel()));
        self.inner.broadcast(t, root, timeout)
    }
    fn reduce(&self, t: &Tensor, op: ReduceOp, root: usize, timeout: Duration) -> dist::Result<()> {
        log(format!("reduce root={root} n={}", t.numel()));
        self.inner.reduce(t, op, root, timeout)
    }
    fn all_gather(
        &self,
        outputs: &[Tensor],
        input: &Tensor,
        timeout: Duration,
    ) -> dist::Result<()> {
        log(format!("all_gather n={}", input.numel()));
        self.inner.all_gather(outputs, input, timeout)
    }
    fn all_gather_into_tensor(
        &self,
        output: &Tensor,
        input: &Tensor,
        timeout: Duration,
    ) -> dist::Result<()> {
        log(format!("all_gather_into_tensor n={}", input.numel()));
        self.inner.all_gather_into_tensor(output, input, timeout)
    }
    fn reduce_scatter(
        &self,
        output: &Tensor,
        inputs: &[Tensor],
        op: ReduceOp,
        timeout: Duration,
    ) -> dist::Result<()> {
        log(format!("reduce_scatter n={}", output.numel()));
        self.inner.reduce_scatter(output, inputs, op, timeout)
    }
    fn reduce_scatter_tensor(
        &self,
        output: &Tensor,
        input: &Tensor,
        op: ReduceOp,
        timeout: Duration,
    ) -> dist::Result<()> {
        log(format!("reduce_scatter_tensor n={}", output.numel()));
        self.inner.reduce_scatter_tensor(output, input, op, timeout)
    }
    fn gather(
        &self,
        input: &Tensor,
        outputs: Option<&[Tensor]>,
        counts: &[usize],
        root: usize,
        timeout: Duration,
    ) -> dist::Result<()> {
        log(format!("gather root={root} n={}", input.numel()));
        self.inner.gather(input, outputs, counts, root, timeout)
    }
    fn scatter(
        &self,
        inputs: Option<&[Tensor]>,
        output: &Tensor,
        counts: &[usize],
        root: usize,
        timeout: Duration,
    ) -> dist::Result<()> {
        log(format!("scatter root={root} n={}", output.numel()));
        self.inner.scatter(inputs, output, counts, root, timeout)
    }
    fn all_to_all(
        &self,
        outputs: &[Tensor],
        inputs: &[Tensor],
        timeout: Duration,
    ) -> dist::Result<()> {
        log("all_to_all".into());
        self.inner.all_to_all(outputs, inputs, timeout)
    }
    fn all_to_all_single(
        &self,
        output: &Tensor,
        input: &Tensor,
        send: &[usize],
        recv: &[usize],
        timeout: Duration,
    ) -> dist::Result<()> {
        log(format!("all_to_all_single n={}", input.numel()));
        self.inner
            .all_to_all_single(output, input, send, recv, timeout)
    }
    fn send(&self, t: &Tensor, dst: usize, tag: u64, timeout: Duration) -> dist::Result<()> {
        log(format!("send dst={dst}"));
        self.inner.send(t, dst, tag, timeout)
    }
    fn recv(&self, t: &Tensor, src: usize, tag: u64, timeout: Duration) -> dist::Result<()> {
        log(format!("recv src={src}"));
        self.inner.recv(t, src, tag, timeout)
    }
    fn transport(&self) -> &'static str {
        "recording"
    }
}

fn init_recording(timeout: Duration) -> dist::Result<()> {
    // registering twice in one process is an error: every test process registers once
    let _ = dist::register_backend("recording", |ctx| {
        Ok(Box::new(Recording::new(ctx)?) as Box<dyn Backend>)
    });
    dist::init_process_group(
        "recording",
        InitOptions {
            timeout,
            ..Default::default()
        },
    )
}

#[test]
fn a_registered_backend_gets_the_checks_translation_and_timeouts() -> TestResult {
    dist::spawn::spawn(3, |rank| -> TestResult {
        init_recording(Duration::from_secs(20))?;
        assert_eq!(dist::get_backend(None)?, "recording");
        assert_eq!(dist::default_group("t")?.transport(), "recording");
        assert!(dist::registered_backends().contains(&"recording".to_string()));
        let e = dist::register_backend("recording", |_| unreachable!()).unwrap_err();
        assert!(e.to_string().contains("already registered"), "{e}");

        // values through the contract, against single-process results
        let xs: Vec<Vec<f64>> = (0..3).map(|r| values(r, 5, 1)).collect();
        let t = tensor(&xs[rank], &[5], DType::F64);
        dist::all_reduce(&t, ReduceOp::Sum, None)?;
        check("all_reduce", as_f64(&t), reduce_ref(ReduceOp::Sum, &xs))?;
        let out = Tensor::zeros(&[6], DType::F32)?;
        dist::all_gather_into_tensor(&out, &tensor(&[rank as f64, 1.0], &[2], DType::F32), None)?;
        check(
            "all_gather_into_tensor",
            as_f64(&out),
            vec![0.0, 1.0, 1.0, 1.0, 2.0, 1.0],
        )?;
        // a strided view is staged above the backend: only its elements change
        let base = tensor(&[1.0, 9.0, 2.0, 9.0], &[2, 2], DType::F32);
        let col = base.select(1, 0)?;
        dist::all_reduce(&col, ReduceOp::Sum, None)?;
        check(
            "strided all_reduce",
            as_f64(&base),
            vec![3.0, 9.0, 6.0, 9.0],
        )?;

        // a dtype the double lacks: refused on every rank, named by the double's dtypes
        let ints = Tensor::zeros(&[2], DType::I64)?;
        let e = dist::all_reduce(&ints, ReduceOp::Sum, None).unwrap_err();
        assert!(
            e.to_string().contains("float32 or float64"),
            "rank {rank}: {e}"
        );

        // a shape mismatch: an error on every rank, and the double never sees the call
        let before = calls().len();
        let bad = Tensor::zeros(&[3 + rank], DType::F32)?;
        let e = dist::all_reduce(&bad, ReduceOp::Sum, None).unwrap_err();
        assert!(
            matches!(e, dist::Error::Mismatch { .. }),
            "rank {rank}: {e}"
        );
        assert_eq!(
            calls().len(),
            before,
            "the double was called for a mismatched call"
        );

        // a backend that panics: the panic is this call's error, and the group goes on
        let p = Tensor::zeros(&[PANIC], DType::F32)?;
        let e = dist::all_reduce(&p, ReduceOp::Sum, None).unwrap_err();
        assert!(
            e.to_string().contains("panics on purpose"),
            "rank {rank}: {e}"
        );
        let t = tensor(&[1.0], &[1], DType::F32);
        dist::all_reduce(&t, ReduceOp::Sum, None)?;
        check("after a backend panic", as_f64(&t), vec![3.0])?;

        // a subgroup: roots reach the double as group ranks, errors leave it as global ranks
        let g = dist::new_group(&[0, 2], None, None)?;
        if rank != 1 {
            let t = tensor(&[rank as f64; 4], &[4], DType::F32);
            dist::broadcast(&t, 2, Some(&g))?;
            check("subgroup broadcast", as_f64(&t), vec![2.0; 4])?;
            assert!(
                calls().iter().any(|c| c == "broadcast root=1 n=4"),
                "global src 2 is group rank 1: {:?}",
                calls()
            );
            let poison = Tensor::zeros(&[POISON], DType::F32)?;
            let e = dist::all_reduce(&poison, ReduceOp::Sum, Some(&g)).unwrap_err();
            let msg = e.to_string();
            assert!(
                matches!(&e, dist::Error::PeerFailed { peer: 2, detail, .. } if detail.ranks() == [2])
                    && msg.contains("rank 2 hung up"),
                "the double's group rank 1 is global rank 2: {msg}"
            );
        }

        // a rank that skips a call: the others time out naming it, through the contract
        let short = dist::new_group(&[0, 1, 2], None, Some(Duration::from_secs(2)))?;
        if rank == 1 {
            std::thread::sleep(Duration::from_secs(4));
        } else {
            let start = Instant::now();
            let t = Tensor::zeros(&[2], DType::F32)?;
            let e = dist::all_reduce(&t, ReduceOp::Sum, Some(&short)).unwrap_err();
            assert!(
                start.elapsed() < Duration::from_secs(15),
                "took {:?}",
                start.elapsed()
            );
            // the rank it waited for is a field: global rank 1, whichever path timed out
            assert!(
                matches!(&e, dist::Error::Timeout { detail, .. } if detail.ranks().contains(&1)),
                "rank {rank}: {e}"
            );
            // the failure reports of the group: ranks 0 and 2 reported, rank 1 did not
            assert!(
                e.to_string().contains("lost: rank 1 (no failure report"),
                "rank {rank}: {e}"
            );
        }
        Ok(())
    })?;
    Ok(())
}
