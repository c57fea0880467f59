//! Runs the repository's conformance vector files (`conformance/*.json`, copied from the
//! reference measurements) with real processes over loopback on the CPU backend. Every record
//! must pass.

use std::path::PathBuf;

use tensorplay_conformance::{RunOptions, run_file};
use tensorplay_core::DType;

fn vectors(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../conformance")
        .join(name)
}

fn run(name: &str, records: usize) {
    run_in(name, records, DType::F64);
}

/// One file in `dtype` (each file and dtype in its own test: `spawn` re-executes the test, and
/// its children run the first `run_file` they reach).
fn run_in(name: &str, records: usize, dtype: DType) {
    let opts = RunOptions {
        dtype,
        ..RunOptions::default()
    };
    let summary = run_file(&vectors(name), &opts).expect("vectors file");
    println!("{summary}");
    assert_eq!(summary.failed, 0, "{summary}");
    assert_eq!(summary.passed, records, "{summary}");
}

#[test]
fn functional_world_2() {
    run("functional-w2.json", 52);
}

#[test]
fn functional_subgroup_world_3() {
    run("functional-subgroup-w3.json", 20);
}

/// Generated from the collectives' math by `conformance/tools/generate.py` (world size 3:
/// every function and op, ties, uneven shapes and splits, the renumbered subgroup {1, 2}).
#[test]
fn generated_world_3() {
    run("functional-w3.json", 220);
}

/// As above for world size 4, with subgroups {1, 2, 3}, {0, 2} and [3, 1] (group rank order
/// differing from global order).
#[test]
fn generated_world_4() {
    run("functional-w4.json", 528);
}

/// The world-2 vectors in bfloat16: inputs and loss weights rounded to bfloat16, expected
/// values rounded from the float64 math, within `tolerance(BF16)` (two epsilons).
#[test]
fn bfloat16_world_2() {
    run_in("functional-w2.json", 52, DType::BF16);
}

/// The subgroup vectors in bfloat16.
#[test]
fn bfloat16_subgroup_world_3() {
    run_in("functional-subgroup-w3.json", 20, DType::BF16);
}

/// The generated world-4 vectors (every function and op, ties, uneven splits) in bfloat16.
#[test]
fn bfloat16_world_4() {
    run_in("functional-w4.json", 528, DType::BF16);
}

/// The world-2 vectors in float16.
#[test]
fn float16_world_2() {
    run_in("functional-w2.json", 52, DType::F16);
}
