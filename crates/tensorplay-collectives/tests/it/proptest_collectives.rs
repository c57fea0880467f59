//! Property tests across real processes: for random shapes and values, all_reduce equals the
//! single-process reduction and all_gather equals the concatenation. Both ranks run the same
//! deterministic proptest stream (fixed seed, no shrinking), so they agree on every case.

use std::time::Duration;

use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};
use tensorplay_collectives::{self as dist, InitOptions, ReduceOp};
use tensorplay_core::{DType, Tensor};

type TestResult = Result<(), Box<dyn std::error::Error + Send + Sync>>;

fn runner() -> TestRunner {
    let config = Config {
        cases: 48,
        max_shrink_iters: 0,
        failure_persistence: None,
        ..Config::default()
    };
    TestRunner::new_with_rng(config, TestRng::deterministic_rng(RngAlgorithm::ChaCha))
}

/// A shape of up to 3 dims and per-element seeds.
fn case() -> impl Strategy<Value = (Vec<usize>, Vec<i32>, u8)> {
    prop::collection::vec(0usize..5, 0..4).prop_flat_map(|shape| {
        let n: usize = shape.iter().product();
        (Just(shape), prop::collection::vec(-50i32..50, n), 0u8..4)
    })
}

/// Rank `r`'s values for a case: the seeds shifted by the rank.
fn rank_values(seeds: &[i32], r: usize) -> Vec<f64> {
    seeds
        .iter()
        .map(|&s| (s + 3 * r as i32) as f64 / 4.0)
        .collect()
}

#[test]
fn all_reduce_and_all_gather_match_one_process() -> TestResult {
    dist::spawn(2, |rank| -> TestResult {
        dist::init_process_group(
            "cpu",
            InitOptions {
                timeout: Duration::from_secs(20),
                ..Default::default()
            },
        )?;
        let n = 2;
        let mut r = runner();
        r.run(&case(), |(shape, seeds, op_pick)| {
            let op = [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min, ReduceOp::Avg][op_pick as usize];
            let mine = Tensor::from_vec(rank_values(&seeds, rank), &shape)
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
            // a copy: all_reduce works in place, and `mine` is gathered below
            let t = mine
                .deep_clone()
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
            dist::all_reduce(&t, op, None).map_err(|e| TestCaseError::fail(e.to_string()))?;
            let all: Vec<Vec<f64>> = (0..n).map(|q| rank_values(&seeds, q)).collect();
            let want: Vec<f64> = (0..seeds.len())
                .map(|i| {
                    let col = all.iter().map(|v| v[i]);
                    match op {
                        ReduceOp::Sum => col.sum(),
                        ReduceOp::Avg => col.sum::<f64>() / n as f64,
                        ReduceOp::Max => col.fold(f64::NEG_INFINITY, f64::max),
                        _ => col.fold(f64::INFINITY, f64::min),
                    }
                })
                .collect();
            prop_assert_eq!(
                t.to_vec::<f64>()
                    .map_err(|e| TestCaseError::fail(e.to_string()))?,
                want
            );
            // all_gather of the same case
            let outs: Vec<Tensor> = (0..n)
                .map(|_| Tensor::zeros(&shape, DType::F64).expect("zeros"))
                .collect();
            dist::all_gather(&outs, &mine, None).map_err(|e| TestCaseError::fail(e.to_string()))?;
            for (q, o) in outs.iter().enumerate() {
                prop_assert_eq!(
                    o.to_vec::<f64>()
                        .map_err(|e| TestCaseError::fail(e.to_string()))?,
                    rank_values(&seeds, q)
                );
            }
            Ok(())
        })
        .map_err(|e| format!("rank {rank}: {e}"))?;
        dist::destroy_process_group()?;
        Ok(())
    })?;
    Ok(())
}
