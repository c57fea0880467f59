//! bfloat16 and float16 reductions in real processes (issue 39): all_reduce (every op),
//! reduce and reduce_scatter at world sizes 2-4, on shared memory (the slot paths, one-shot
//! and two-shot, and cross-memory attach) and over TCP (`TENSORPLAY_SHM=0`), against the
//! float64 result rounded once to the 16-bit type.
//!
//! Inputs are multiples of 1/256 in [-1, 1] (exact in both types; their float32 sums over at
//! most four ranks are exact too, so one rounding gives exactly the float64 sum rounded once):
//! shared memory and the default TCP mode (partial sums in float32) must match bit for bit.
//! `Avg` divides the exact float32 sum by the group size in float32 before the one rounding
//! (the expected value is computed the same way; for 2 and 4 ranks it is the float64 mean
//! rounded once). Products use small integers (exact). The TCP `hop` mode
//! (`TENSORPLAY_RING_16BIT=hop`, which rounds at each hop) is checked against its documented
//! bound `(n - 1) * u * sum |x_i|` (`u` = 2^-8 for bfloat16, 2^-11 for float16), plus one
//! rounding of the result.

use std::time::Duration;

use tensorplay_collectives::{self as dist, ReduceOp, SpawnOptions};
use tensorplay_core::{DType, Tensor, bf16, f16};

use super::{TestResult, init, tensor};

/// Rank `r`'s `n` inputs: multiples of 1/256 in [-1, 1], or small integers (`ints`).
fn vals(r: usize, n: usize, ints: bool) -> Vec<f64> {
    (0..n)
        .map(|i| {
            let h =
                ((i as u64).wrapping_mul(2_654_435_761) + (r as u64 + 1) * 3_928_791) % (1 << 32);
            if ints {
                (h % 5) as f64 - 2.0
            } else {
                ((h % 513) as f64 - 256.0) / 256.0
            }
        })
        .collect()
}

/// `v` rounded once to `dt`.
fn round(dt: DType, v: f64) -> f64 {
    match dt {
        DType::BF16 => bf16::from_f64(v).to_f64(),
        _ => f16::from_f64(v).to_f64(),
    }
}

/// The unit roundoff of `dt`.
fn unit(dt: DType) -> f64 {
    if dt == DType::BF16 {
        2f64.powi(-8)
    } else {
        2f64.powi(-11)
    }
}

/// The expected reduction of column `i` over the ranks' inputs `xs`, rounded once.
fn expected(dt: DType, op: ReduceOp, xs: &[Vec<f64>], i: usize) -> f64 {
    let col = xs.iter().map(|x| x[i]);
    match op {
        ReduceOp::Sum => round(dt, col.sum()),
        // the float32 sum (exact) divided in float32, rounded once
        ReduceOp::Avg => round(dt, (col.sum::<f64>() as f32 / xs.len() as f32) as f64),
        ReduceOp::Product => round(dt, col.product()),
        ReduceOp::Max => col.fold(f64::NEG_INFINITY, f64::max),
        ReduceOp::Min => col.fold(f64::INFINITY, f64::min),
        _ => unreachable!("bitwise ops are refused for floats"),
    }
}

/// How results are compared: bit for bit, or within the per-hop rounding bound.
#[derive(Clone, Copy, PartialEq)]
enum Cmp {
    Exact,
    HopBound,
}

fn compare(
    dt: DType,
    cmp: Cmp,
    what: &str,
    got: &Tensor,
    xs: &[Vec<f64>],
    op: ReduceOp,
    block: std::ops::Range<usize>,
) -> TestResult {
    let g = got.to_vec_f64()?;
    let n = xs.len() as f64;
    for (j, i) in block.enumerate() {
        let want = expected(dt, op, xs, i);
        let ok = match cmp {
            Cmp::Exact => g[j] == want,
            Cmp::HopBound => {
                let mag: f64 = xs.iter().map(|x| x[i].abs()).sum();
                let exact = want;
                let scale = if op == ReduceOp::Avg { n } else { 1.0 };
                (g[j] - exact).abs() <= ((n - 1.0) * mag / scale + 2.0 * exact.abs()) * unit(dt)
            }
        };
        if !ok {
            return Err(format!("{what}: element {i}: got {}, want {want}", g[j]).into());
        }
    }
    Ok(())
}

/// Every 16-bit reduction of one world, on whatever path it was started on.
fn reductions(rank: usize, k: usize, cmp: Cmp, lens: &[usize]) -> TestResult {
    for dt in [DType::BF16, DType::F16] {
        for &len in lens {
            let tag = format!("{dt} len {len} (world {k})");
            for op in [
                ReduceOp::Sum,
                ReduceOp::Avg,
                ReduceOp::Max,
                ReduceOp::Min,
                ReduceOp::Product,
            ] {
                if cmp == Cmp::HopBound && !matches!(op, ReduceOp::Sum | ReduceOp::Avg) {
                    continue;
                }
                let xs: Vec<Vec<f64>> = (0..k)
                    .map(|r| vals(r, len, op == ReduceOp::Product))
                    .collect();
                let t = tensor(&xs[rank], &[len], dt);
                dist::all_reduce(&t, op, None)?;
                assert_eq!(t.dtype(), dt, "all_reduce keeps the dtype");
                compare(
                    dt,
                    cmp,
                    &format!("all_reduce {op:?} {tag}"),
                    &t,
                    &xs,
                    op,
                    0..len,
                )?;
            }
            let xs: Vec<Vec<f64>> = (0..k).map(|r| vals(r, len, false)).collect();
            let t = tensor(&xs[rank], &[len], dt);
            dist::reduce(&t, k - 1, ReduceOp::Avg, None)?;
            if rank == k - 1 {
                compare(
                    dt,
                    cmp,
                    &format!("reduce Avg {tag}"),
                    &t,
                    &xs,
                    ReduceOp::Avg,
                    0..len,
                )?;
            } else if t.to_vec_f64()? != tensor(&xs[rank], &[len], dt).to_vec_f64()? {
                return Err(format!("reduce {tag}: a non-root's data changed").into());
            }
            let m = len.div_ceil(k).max(1);
            let xs: Vec<Vec<f64>> = (0..k).map(|r| vals(r, k * m, false)).collect();
            for op in [ReduceOp::Sum, ReduceOp::Avg] {
                let out = Tensor::zeros(&[m], dt)?;
                dist::reduce_scatter_tensor(&out, &tensor(&xs[rank], &[k * m], dt), op, None)?;
                compare(
                    dt,
                    cmp,
                    &format!("reduce_scatter_tensor {op:?} {tag}"),
                    &out,
                    &xs,
                    op,
                    rank * m..(rank + 1) * m,
                )?;
            }
        }
    }
    Ok(())
}

/// One world of `k` ranks with `env`, asserting its transport.
fn world(
    k: usize,
    env: &[(&str, &str)],
    transport: &'static str,
    cmp: Cmp,
    lens: &'static [usize],
) -> TestResult {
    let mut o = SpawnOptions::new(k);
    o.timeout = Some(Duration::from_secs(120));
    o.env = env
        .iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect();
    dist::spawn_with(o, move |rank| -> TestResult {
        init(60)?;
        assert_eq!(
            dist::default_group("test")?.transport(),
            transport,
            "world {k}"
        );
        reductions(rank, k, cmp, lens)?;
        dist::destroy_process_group()?;
        Ok(())
    })
    .map_err(|e| format!("world {k} {env:?}: {e}").into())
}

/// Lengths around the test slot (1 KiB: one-shot up to 2,048 16-bit elements, two-shot and
/// several rounds above) and the float32 pieces of the reduction (4,096 elements).
const LENS: &[usize] = &[0, 1, 7, 600, 5003];
const SLOT: (&str, &str) = ("TENSORPLAY_SHM_SLOT_BYTES", "1024");

#[test]
fn bf16_f16_world_2_shm_rounds_once() -> TestResult {
    world(2, &[SLOT], "shm", Cmp::Exact, LENS)
}

#[test]
fn bf16_f16_world_3_shm_rounds_once() -> TestResult {
    world(3, &[SLOT], "shm", Cmp::Exact, LENS)
}

#[test]
fn bf16_f16_world_4_shm_rounds_once() -> TestResult {
    world(4, &[SLOT], "shm", Cmp::Exact, LENS)
}

#[test]
fn bf16_f16_world_3_cross_memory_attach_rounds_once() -> TestResult {
    // reduce_scatter inputs of 3 * 65,536 16-bit elements (384 KiB) take cross-memory attach
    world(
        3,
        &[("TENSORPLAY_SHM_CMA", "require")],
        "shm",
        Cmp::Exact,
        &[3 * 65_536],
    )
}

#[test]
fn bf16_f16_world_2_tcp_rounds_once() -> TestResult {
    world(2, &[("TENSORPLAY_SHM", "0")], "tcp", Cmp::Exact, LENS)
}

#[test]
fn bf16_f16_world_4_tcp_rounds_once() -> TestResult {
    // above 64 KiB the TCP all_reduce is a ring: 40,000 elements are 160 KiB in float32
    world(
        4,
        &[("TENSORPLAY_SHM", "0")],
        "tcp",
        Cmp::Exact,
        &[0, 1, 600, 40_000],
    )
}

#[test]
fn bf16_f16_world_4_tcp_hop_rounding_within_its_bound() -> TestResult {
    let env = [("TENSORPLAY_SHM", "0"), ("TENSORPLAY_RING_16BIT", "hop")];
    world(4, &env, "tcp", Cmp::HopBound, &[600, 40_000])
}
