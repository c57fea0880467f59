//! In-process tests of the `"cpu"` backend: one thread per rank, each with its own
//! `CpuBackend` over a shared `MemoryStore`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tensorplay_collectives::backend::cpu::CpuBackend;
use tensorplay_collectives::backend::{BufMut, BufRef, HostBackend};
use tensorplay_collectives::store::{MemoryStore, PrefixStore, Store};
use tensorplay_collectives::{Error, Part, ReduceOp, Result};

const T: Duration = Duration::from_secs(30);

/// A typed vector built from integer values (exact in every dtype for the values used).
#[derive(Debug, Clone, PartialEq)]
enum V {
    F32(Vec<f32>),
    F64(Vec<f64>),
    I64(Vec<i64>),
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Dt {
    F32,
    F64,
    I64,
}

const DTYPES: [Dt; 3] = [Dt::F32, Dt::F64, Dt::I64];

impl V {
    fn of(dt: Dt, xs: &[i64]) -> V {
        match dt {
            Dt::F32 => V::F32(xs.iter().map(|&x| x as f32).collect()),
            Dt::F64 => V::F64(xs.iter().map(|&x| x as f64).collect()),
            Dt::I64 => V::I64(xs.to_vec()),
        }
    }
    fn zeros(dt: Dt, n: usize) -> V {
        V::of(dt, &vec![0; n])
    }
    fn m(&mut self) -> BufMut<'_> {
        match self {
            V::F32(v) => BufMut::F32(v),
            V::F64(v) => BufMut::F64(v),
            V::I64(v) => BufMut::I64(v),
        }
    }
    fn r(&self) -> BufRef<'_> {
        match self {
            V::F32(v) => BufRef::F32(v),
            V::F64(v) => BufRef::F64(v),
            V::I64(v) => BufRef::I64(v),
        }
    }
}

fn ops_for(dt: Dt) -> Vec<ReduceOp> {
    use ReduceOp::*;
    match dt {
        Dt::I64 => vec![Sum, Product, Min, Max, Avg, BAnd, BOr, BXor],
        _ => vec![Sum, Product, Min, Max, Avg],
    }
}

/// Rank `r`'s element `i` (small positive integers, so products stay exact).
fn val(r: usize, i: usize, op: ReduceOp) -> i64 {
    match op {
        ReduceOp::Product => ((r * 7 + i * 3) % 5 + 1) as i64,
        ReduceOp::BAnd | ReduceOp::BOr | ReduceOp::BXor => ((r * 37 + i * 11) % 256) as i64,
        _ => ((r * 7 + i * 3) % 11) as i64 - 3,
    }
}

fn combine(op: ReduceOp, a: i64, b: i64) -> i64 {
    match op {
        ReduceOp::Sum | ReduceOp::Avg => a + b,
        ReduceOp::Product => a * b,
        ReduceOp::Min => a.min(b),
        ReduceOp::Max => a.max(b),
        ReduceOp::BAnd => a & b,
        ReduceOp::BOr => a | b,
        ReduceOp::BXor => a ^ b,
    }
}

fn expected_reduce(size: usize, n: usize, op: ReduceOp, off: usize) -> Vec<i64> {
    (0..n)
        .map(|i| {
            (1..size).fold(val(0, i + off, op), |a, r| {
                combine(op, a, val(r, i + off, op))
            })
        })
        .collect()
}

fn input(rank: usize, n: usize, op: ReduceOp) -> Vec<i64> {
    (0..n).map(|i| val(rank, i, op)).collect()
}

/// Runs `f(backend)` on `size` threads (ranks) and returns their results in rank order.
fn world<R: Send + 'static>(
    size: usize,
    timeout: Duration,
    f: impl Fn(CpuBackend) -> R + Send + Sync + 'static,
) -> Vec<Result<R>> {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let f = Arc::new(f);
    let hs: Vec<_> = (0..size)
        .map(|rank| {
            let store: Arc<dyn Store> = Arc::new(PrefixStore::new("g0", Arc::clone(&store)));
            let f = Arc::clone(&f);
            std::thread::spawn(move || CpuBackend::new(store, rank, size, timeout).map(|b| f(b)))
        })
        .collect();
    hs.into_iter()
        .map(|h| h.join().expect("rank thread panicked"))
        .collect()
}

const SIZES: [usize; 5] = [0, 1, 7, 1000, 3 * 1024 * 1024 / 4];

fn check_all_reduce(b: &CpuBackend) {
    let (r, size) = (b.rank(), b.size());
    for dt in DTYPES {
        for op in ops_for(dt) {
            for n in SIZES {
                let mut v = V::of(dt, &input(r, n, op));
                b.all_reduce(v.m(), op, T).unwrap();
                assert_eq!(
                    v,
                    V::of(dt, &expected_reduce(size, n, op, 0)),
                    "all_reduce {dt:?} {op:?} n={n} size={size} rank={r}"
                );
            }
        }
        // Bitwise ops on floats are errors, without touching the network.
        if dt != Dt::I64 {
            let mut v = V::zeros(dt, 3);
            assert!(b.all_reduce(v.m(), ReduceOp::BXor, T).is_err());
        }
    }
}

fn check_broadcast_reduce(b: &CpuBackend) {
    let (r, size) = (b.rank(), b.size());
    for dt in DTYPES {
        for n in SIZES {
            for root in 0..size {
                let mut v = V::of(dt, &input(r, n, ReduceOp::Sum));
                b.broadcast(v.m(), root, T).unwrap();
                assert_eq!(
                    v,
                    V::of(dt, &input(root, n, ReduceOp::Sum)),
                    "broadcast {dt:?} n={n}"
                );
            }
            for op in ops_for(dt) {
                let root = n % size;
                let mut v = V::of(dt, &input(r, n, op));
                b.reduce(v.m(), op, root, T).unwrap();
                let want = if r == root {
                    expected_reduce(size, n, op, 0)
                } else {
                    input(r, n, op)
                };
                assert_eq!(
                    v,
                    V::of(dt, &want),
                    "reduce {dt:?} {op:?} n={n} root={root} rank={r}"
                );
            }
        }
    }
}

fn counts_for(size: usize, n: usize) -> Vec<usize> {
    (0..size)
        .map(|r| if r == 1 { 0 } else { n + r * (r % 2 * 2 + 1) })
        .collect()
}

fn check_gathers(b: &CpuBackend) {
    let (r, size) = (b.rank(), b.size());
    let op = ReduceOp::Sum;
    for dt in DTYPES {
        for n in SIZES {
            let counts = counts_for(size, n / size.max(1));
            let total: usize = counts.iter().sum();
            let mine: Vec<i64> = (0..counts[r])
                .map(|i| val(r, i, op) * 1000 + r as i64)
                .collect();
            let want: Vec<i64> = (0..size)
                .flat_map(|p| (0..counts[p]).map(move |i| val(p, i, op) * 1000 + p as i64))
                .collect();
            let inp = V::of(dt, &mine);
            // all_gather
            let mut out = V::zeros(dt, total);
            b.all_gather(inp.r(), out.m(), &counts, T).unwrap();
            assert_eq!(out, V::of(dt, &want), "all_gather {dt:?} n={n}");
            // gather / scatter with every root
            for root in 0..size {
                let mut out = V::zeros(dt, total);
                let o = if r == root { Some(out.m()) } else { None };
                b.gather(inp.r(), o, &counts, root, T).unwrap();
                if r == root {
                    assert_eq!(out, V::of(dt, &want), "gather {dt:?} n={n} root={root}");
                }
                let full = V::of(dt, &want);
                let mut part = V::zeros(dt, counts[r]);
                let i = if r == root { Some(full.r()) } else { None };
                b.scatter(i, part.m(), &counts, root, T).unwrap();
                assert_eq!(
                    part,
                    V::of(dt, &want_block(&want, &counts, r)),
                    "scatter {dt:?}"
                );
            }
            // reduce_scatter: blocks of m elements
            for op in ops_for(dt) {
                let m = n / size.max(1);
                let inp = V::of(dt, &input(r, m * size, op));
                let mut out = V::zeros(dt, m);
                b.reduce_scatter(inp.r(), out.m(), op, T).unwrap();
                let want = expected_reduce(size, m, op, r * m);
                assert_eq!(out, V::of(dt, &want), "reduce_scatter {dt:?} {op:?} m={m}");
            }
            // all_to_all with uneven (and zero) counts: rank s sends (s + d + n) % 4 * k to d.
            let k = n / (size * size).max(1) + 1;
            let cnt = |s: usize, d: usize| (s + 2 * d + n) % 4 * k;
            let send: Vec<usize> = (0..size).map(|d| cnt(r, d)).collect();
            let recv: Vec<usize> = (0..size).map(|s| cnt(s, r)).collect();
            let elem = |s: usize, d: usize, i: usize| (s * 1_000_000 + d * 10_000 + i) as i64;
            let mine: Vec<i64> = (0..size)
                .flat_map(|d| (0..cnt(r, d)).map(move |i| elem(r, d, i) % 1_000_000))
                .collect();
            let want: Vec<i64> = (0..size)
                .flat_map(|s| (0..cnt(s, r)).map(move |i| elem(s, r, i) % 1_000_000))
                .collect();
            let inp = V::of(dt, &mine);
            let mut out = V::zeros(dt, want.len());
            b.all_to_all(inp.r(), &send, out.m(), &recv, T).unwrap();
            assert_eq!(out, V::of(dt, &want), "all_to_all {dt:?} n={n}");
        }
    }
    b.barrier(T).unwrap();
}

fn want_block(all: &[i64], counts: &[usize], r: usize) -> Vec<i64> {
    let start: usize = counts[..r].iter().sum();
    all[start..start + counts[r]].to_vec()
}

fn check_p2p(b: &CpuBackend) {
    let (r, size) = (b.rank(), b.size());
    if size < 2 {
        return;
    }
    // Ring of sends: even ranks send first, odd ranks receive first.
    for n in SIZES {
        let next = (r + 1) % size;
        let prev = (r + size - 1) % size;
        let mine = V::of(Dt::F64, &input(r, n, ReduceOp::Sum));
        let mut got = V::zeros(Dt::F64, n);
        if r % 2 == 0 {
            b.send(mine.r(), next, 7, T).unwrap();
            b.recv(got.m(), prev, 7, T).unwrap();
        } else {
            b.recv(got.m(), prev, 7, T).unwrap();
            b.send(mine.r(), next, 7, T).unwrap();
        }
        assert_eq!(got, V::of(Dt::F64, &input(prev, n, ReduceOp::Sum)));
    }
}

fn check_everything(size: usize) {
    let before = Instant::now();
    let res = world(size, T, |b| {
        check_all_reduce(&b);
        check_broadcast_reduce(&b);
        check_gathers(&b);
        check_p2p(&b);
        b.barrier(T).unwrap();
        b.bytes_sent()
    });
    for (r, x) in res.into_iter().enumerate() {
        let sent = x.unwrap();
        assert_eq!(sent > 0, size > 1, "bytes_sent of rank {r}");
    }
    eprintln!("world {size}: {:?}", before.elapsed());
}

#[test]
fn world_1_every_op() {
    check_everything(1);
}

#[test]
fn world_2_every_op() {
    check_everything(2);
}

#[test]
fn world_3_every_op() {
    check_everything(3);
}

#[test]
fn world_4_every_op() {
    check_everything(4);
}

#[test]
fn rank_that_never_joins_times_out_naming_it() {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let hs: Vec<_> = (0..2)
        .map(|rank| {
            let store = Arc::clone(&store);
            std::thread::spawn(move || CpuBackend::new(store, rank, 3, Duration::from_secs(1)))
        })
        .collect();
    let start = Instant::now();
    for h in hs {
        match h.join().unwrap() {
            // "ranks [2] of 3 never joined (...)": the missing ranks are a typed list
            Err(Error::Timeout { detail, .. }) => {
                assert!(detail.parts().contains(&Part::Ranks(vec![2])), "{detail}")
            }
            other => panic!("expected a timeout naming rank 2, got {other:?}"),
        }
    }
    assert!(start.elapsed() < Duration::from_secs(5));
}

#[test]
fn peer_dropping_mid_collective_fails_fast() {
    for n in [1000usize, 4 << 20] {
        let start = Instant::now();
        let res = world(3, Duration::from_secs(20), move |b| {
            if b.rank() == 2 {
                drop(b);
                return Ok(());
            }
            let mut v = vec![1.0f32; n];
            let r = b.all_reduce(BufMut::F32(&mut v), ReduceOp::Sum, Duration::from_secs(10));
            // Once failed, the backend stays failed.
            assert!(b.barrier(Duration::from_secs(1)).is_err());
            r
        });
        for (rank, r) in res.into_iter().enumerate().take(2) {
            match r.unwrap() {
                Err(Error::PeerFailed { .. } | Error::Timeout { .. }) => {}
                other => panic!("rank {rank}: expected PeerFailed/Timeout, got {other:?}"),
            }
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{:?}",
            start.elapsed()
        );
    }
}

#[test]
fn mismatched_lengths_error_on_every_rank() {
    for size in [2, 3] {
        for base in [10usize, 1 << 20] {
            let start = Instant::now();
            let res = world(size, Duration::from_secs(20), move |b| {
                let mut v = vec![1.0f64; base + b.rank()];
                b.all_reduce(BufMut::F64(&mut v), ReduceOp::Sum, Duration::from_secs(10))
            });
            for (rank, r) in res.into_iter().enumerate() {
                let r = r.unwrap();
                assert!(r.is_err(), "size {size} base {base} rank {rank}: {r:?}");
            }
            assert!(start.elapsed() < Duration::from_secs(10));
        }
    }
}

#[test]
fn mismatched_calls_are_reported() {
    let res = world(2, T, |b| {
        let mut v = vec![1i64; 4];
        if b.rank() == 0 {
            b.all_reduce(BufMut::I64(&mut v), ReduceOp::Sum, T)
        } else {
            b.broadcast(BufMut::I64(&mut v), 1, T)
        }
    });
    match res[0].as_ref().unwrap() {
        Err(Error::Mismatch { detail, .. }) => assert!(detail.contains("broadcast"), "{detail}"),
        other => panic!("{other:?}"),
    }
    // Tag mismatch on recv.
    let res = world(2, T, |b| {
        let mut v = vec![1.0f32; 4];
        if b.rank() == 0 {
            b.send(BufRef::F32(&v), 1, 5, T)
        } else {
            b.recv(BufMut::F32(&mut v), 0, 6, T)
        }
    });
    assert!(res[0].as_ref().unwrap().is_ok());
    match res[1].as_ref().unwrap() {
        Err(Error::Mismatch { detail, .. }) => assert!(detail.contains("tag 5"), "{detail}"),
        other => panic!("{other:?}"),
    }
}

/// Two-rank all_reduce bandwidth (run with `--release -- --ignored --nocapture`).
#[test]
#[ignore]
fn bandwidth_2_ranks() {
    for bytes in [4usize << 10, 1 << 20, 16 << 20, 64 << 20] {
        let res = world(2, T, move |b| {
            let n = bytes / 4;
            let mut v = vec![1.0f32; n];
            let iters = if bytes < (1 << 20) { 2000 } else { 20 };
            for _ in 0..3 {
                b.all_reduce(BufMut::F32(&mut v), ReduceOp::Sum, T).unwrap();
            }
            b.barrier(T).unwrap();
            let t = Instant::now();
            for _ in 0..iters {
                b.all_reduce(BufMut::F32(&mut v), ReduceOp::Sum, T).unwrap();
            }
            t.elapsed() / iters
        });
        let t = res[0].as_ref().unwrap();
        let gbs = bytes as f64 / t.as_secs_f64() / 1e9;
        eprintln!("all_reduce {bytes:>9} B: {t:?} per call, busbw {gbs:.2} GB/s");
    }
}
