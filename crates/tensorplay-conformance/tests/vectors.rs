//! Runs the repository's conformance vector files (`conformance/*.json`, copied from the
//! reference measurements) with real processes over loopback on the CPU backend. Every record
//! must pass.

use std::path::PathBuf;

use tensorplay_conformance::{RunOptions, run_file};

fn vectors(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../conformance")
        .join(name)
}

fn run(name: &str, records: usize) {
    let summary = run_file(&vectors(name), &RunOptions::default()).expect("vectors file");
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
