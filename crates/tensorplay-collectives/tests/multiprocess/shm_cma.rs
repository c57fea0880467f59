//! Cross-memory attach on the shared-memory transport (`TENSORPLAY_SHM_CMA`): large
//! reduce_scatter (by default) and all_gather and gather (`all`) read peers' tensors in place.
//! Each world runs with it required for every one of them (`require`: group creation fails
//! where it cannot be used, so a silent fallback fails the test), by default, with ranks asking
//! for different things (they must agree on one path), and turned off (`0`, the slot path), at
//! sizes around the crate's threshold
//! (256 KiB moved) and its reduce_scatter piece (256 KiB), for every dtype the backend moves,
//! with uneven blocks and an input that is a view of the output. Results are compared bit for
//! bit with one process reducing in rank order in the dtype's own arithmetic.

use std::time::Duration;

use tensorplay_collectives::{self as dist, ReduceOp, SpawnOptions};
use tensorplay_core::{DType, Tensor};

use super::{TestResult, init, tensor};

/// The crate's threshold and reduce_scatter piece, in bytes.
const CMA_MIN: usize = 256 << 10;
const PIECE: usize = 256 << 10;

fn size_of(dt: DType) -> usize {
    if dt == DType::F32 { 4 } else { 8 }
}

/// Rounds a value to what `dt` holds (float32 results of float32 operands are the float64
/// results rounded once: exact for +, *, min and max; int64 has no negative zero).
fn round(dt: DType, v: f64) -> f64 {
    match dt {
        DType::F32 => v as f32 as f64,
        DType::I64 => v as i64 as f64,
        _ => v,
    }
}

/// Rank `r`'s `n` values: fractions for floats (so the order of additions shows in the bits),
/// small integers for int64.
fn vals(dt: DType, r: usize, n: usize, salt: usize) -> Vec<f64> {
    (0..n)
        .map(|i| {
            let k = (r * 31 + i * 17 + salt * 7) % 1000;
            if dt == DType::I64 {
                (k % 19) as f64 - 9.0
            } else {
                round(dt, k as f64 / 7.0 - 50.0)
            }
        })
        .collect()
}

/// One process's reduction of `xs` in rank order, rounding to `dt` after every operation.
fn fold(dt: DType, op: ReduceOp, xs: &[Vec<f64>]) -> Vec<f64> {
    (0..xs[0].len())
        .map(|i| {
            let mut acc = xs[0][i];
            for x in &xs[1..] {
                let (a, b) = (acc, x[i]);
                acc = round(
                    dt,
                    match op {
                        ReduceOp::Sum => a + b,
                        ReduceOp::Product => a * b,
                        ReduceOp::Max => a.max(b),
                        ReduceOp::Min => a.min(b),
                        ReduceOp::BAnd => ((a as i64) & (b as i64)) as f64,
                        ReduceOp::BOr => ((a as i64) | (b as i64)) as f64,
                        ReduceOp::BXor => ((a as i64) ^ (b as i64)) as f64,
                        ReduceOp::Avg => unreachable!("not in these cases"),
                    },
                );
            }
            acc
        })
        .collect()
}

fn ops(dt: DType) -> Vec<ReduceOp> {
    let mut v = vec![ReduceOp::Sum, ReduceOp::Product, ReduceOp::Max];
    if dt == DType::I64 {
        v.extend([ReduceOp::BAnd, ReduceOp::BXor]);
    }
    v
}

/// Exact comparison (the paths must agree bit for bit with one process).
fn same(what: &str, got: &Tensor, want: &[f64]) -> TestResult {
    let g = got.to_vec_f64()?;
    if g.len() != want.len() {
        return Err(format!("{what}: {} values, want {}", g.len(), want.len()).into());
    }
    if let Some(i) = (0..g.len()).find(|&i| g[i].to_bits() != want[i].to_bits()) {
        return Err(format!("{what}: element {i} is {}, want {}", g[i], want[i]).into());
    }
    Ok(())
}

/// Block lengths (elements per rank) for world `k`: the largest all_gather below the
/// threshold and the smallest at it, a reduce_scatter block that is not a multiple of the
/// piece, and a large one.
fn lengths(dt: DType, k: usize) -> Vec<usize> {
    let es = size_of(dt);
    let at = (CMA_MIN / es).div_ceil(k);
    vec![at - k, at, 3 * PIECE / es + 5, (5 << 20) / es + 3]
}

/// Every covered collective at every length, in the world of `k` ranks.
fn cases(rank: usize, k: usize) -> TestResult {
    for dt in [DType::F32, DType::F64, DType::I64] {
        for len in lengths(dt, k) {
            let tag = format!("{dt} block {len} (world {k})");
            // all_gather, uneven: rank r contributes len + r elements
            let outs: Vec<Tensor> = (0..k)
                .map(|r| Tensor::zeros(&[len + r], dt))
                .collect::<Result<_, _>>()?;
            let mine = vals(dt, rank, len + rank, 1);
            dist::all_gather(&outs, &tensor(&mine, &[len + rank], dt), None)?;
            for (r, o) in outs.iter().enumerate() {
                same(
                    &format!("all_gather block {r} {tag}"),
                    o,
                    &vals(dt, r, len + r, 1),
                )?;
            }
            // all_gather_into_tensor with the input a view of the output (as FSDP's shards)
            let out = Tensor::zeros(&[k * len], dt)?;
            let shard = out.narrow(0, rank * len, len)?;
            shard.copy_(&tensor(&vals(dt, rank, len, 2), &[len], dt))?;
            dist::all_gather_into_tensor(&out, &shard, None)?;
            let want: Vec<f64> = (0..k).flat_map(|r| vals(dt, r, len, 2)).collect();
            same(&format!("all_gather aliased {tag}"), &out, &want)?;
            // gather to the last rank
            let list: Vec<Tensor> = (0..k)
                .map(|_| Tensor::zeros(&[len], dt))
                .collect::<Result<_, _>>()?;
            let x = tensor(&vals(dt, rank, len, 3), &[len], dt);
            dist::gather(&x, (rank == k - 1).then_some(list.as_slice()), k - 1, None)?;
            if rank == k - 1 {
                for (r, l) in list.iter().enumerate() {
                    same(&format!("gather block {r} {tag}"), l, &vals(dt, r, len, 3))?;
                }
            }
            for op in ops(dt) {
                let ys: Vec<Vec<f64>> = (0..k).map(|r| vals(dt, r, k * len, 4)).collect();
                let full = fold(dt, op, &ys);
                let out = Tensor::zeros(&[len], dt)?;
                dist::reduce_scatter_tensor(&out, &tensor(&ys[rank], &[k * len], dt), op, None)?;
                same(
                    &format!("reduce_scatter {op:?} {tag}"),
                    &out,
                    &full[rank * len..(rank + 1) * len],
                )?;
            }
        }
    }
    Ok(())
}

/// One world of `k` ranks with `TENSORPLAY_SHM_CMA=<cma>`, or on rank 0 only `all` when
/// `cma` is `mixed` (the others keep the default).
fn world(k: usize, cma: &'static str) -> TestResult {
    let mut o = SpawnOptions::new(k);
    o.timeout = Some(Duration::from_secs(300));
    if cma != "mixed" {
        o.env = vec![("TENSORPLAY_SHM_CMA".into(), cma.into())];
    }
    dist::spawn_with(o, move |rank| -> TestResult {
        if cma == "mixed" && rank == 0 {
            // SAFETY: no other thread of this child reads the environment now (libtest's main
            // thread waits for this test; the group and its threads are created below).
            unsafe { std::env::set_var("TENSORPLAY_SHM_CMA", "all") };
        }
        init(60)?;
        assert_eq!(dist::default_group("test")?.transport(), "shm");
        cases(rank, k)?;
        dist::destroy_process_group()?;
        Ok(())
    })
    .map_err(|e| format!("world {k}, TENSORPLAY_SHM_CMA={cma}: {e}"))?;
    Ok(())
}

// one spawned world per test (spawn re-executes the test, so one spawn call per test)
macro_rules! worlds {
    ($($name:ident: $n:expr, $cma:expr;)*) => {$(
        #[test]
        fn $name() -> TestResult {
            world($n, $cma)
        }
    )*};
}

worlds! {
    cma_world_2: 2, "require";
    cma_world_3: 3, "require";
    cma_default_world_2: 2, "1";
    cma_mixed_world_3: 3, "mixed";
    cma_off_world_2: 2, "0";
    cma_off_world_3: 3, "0";
}

/// `require` on one rank while another turns cross-memory attach off: that rank's group
/// creation fails and says why (the other rank is free to fail or not, but must not hang).
#[test]
fn cma_required_where_a_rank_refuses_fails_group_creation() -> TestResult {
    let mut o = SpawnOptions::new(2);
    o.timeout = Some(Duration::from_secs(120));
    dist::spawn_with(o, |rank| -> TestResult {
        let mode = if rank == 0 { "require" } else { "0" };
        // SAFETY: no other thread of this child reads the environment now (libtest's main
        // thread waits for this test; the group and its threads are created below).
        unsafe { std::env::set_var("TENSORPLAY_SHM_CMA", mode) };
        let r = init(10).and_then(|()| dist::barrier(None));
        if rank == 0 {
            let e = match r {
                Ok(()) => return Err("rank 0 created the group despite `require`".into()),
                Err(e) => e.to_string(),
            };
            assert!(
                e.contains("TENSORPLAY_SHM_CMA=require"),
                "rank 0 error names the setting: {e}"
            );
        }
        Ok(())
    })?;
    Ok(())
}
