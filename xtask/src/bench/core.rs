//! `bench-core`: the core benchmark (`cargo bench -p tensorplay-core --bench core_step`: the
//! MLP training step and f32 matmul GFLOP/s) and the GPT training step of `gpt_distributed`
//! (`cargo bench --bench gpt_step`), beside PyTorch's `torch_core_step.py` (anchors' folder)
//! and `benchmarks/torch_gpt.py step`, and the kernels' bench (`--bench ops_step`) beside
//! `torch_ops_step.py`, alternately for `--rounds` rounds; the summary keeps each program's best
//! round: `mlp_step`, `matmul_512`, `matmul_1024`, `gpt_step`, `exp_1m`, `softmax_1m`,
//! `layernorm_1m`, `gelu_tanh_1m`, `sdpa_causal`; `matmul_bf16_1024` and
//! `gpt_step_autocast_bf16` beside the anchors' `torch_bf16_step.py` (PyTorch's oneDNN bfloat16
//! matmul and its CPU autocast step with fused AdamW); and `gpt_train_2_threads`, the main job's
//! single-process recipe for 200 steps on two threads (`gpt_distributed --single-process
//! --threads 2 --steps 200`) beside `OMP_NUM_THREADS=2 torch_gpt.py train 200`.

use std::path::Path;
use std::process::Command;

use super::anchor::{Pytorch, torch_with};
use super::parse::{Metric, parse_bf16, parse_core, parse_train_seconds};
use super::summary::{Goal, Row, print_summary};
use super::{Common, best, higher_is_better, run_torch, run_torch_threads};
use crate::packages::GPT_BENCH_PACKAGE;
use crate::process::run_capture;

/// The flags of `bench-core`.
#[derive(clap::Args)]
pub(crate) struct Args {
    #[command(flatten)]
    pub(crate) common: Common,
}

/// The summary's rows, in order: metric, unit and goal (ratio = tensorplay / pytorch).
const ROWS: &[(&str, &str, Goal)] = &[
    ("mlp_step", "us/step", Goal::AtMost(0.5)),
    ("matmul_512", "GFLOP/s", Goal::AtLeast(0.8)),
    ("matmul_1024", "GFLOP/s", Goal::AtLeast(0.8)),
    ("gpt_step", "us/step", Goal::AtMost(0.8)),
    ("matmul_bf16_1024", "GFLOP/s", Goal::AtLeast(1.0)),
    ("gpt_step_autocast_bf16", "us/step", Goal::AtMost(1.0)),
    ("gpt_train_2_threads", "s", Goal::AtMost(1.0)),
    ("exp_1m", "us", Goal::AtMost(1.0)),
    ("softmax_1m", "us", Goal::AtMost(1.0)),
    ("layernorm_1m", "us", Goal::AtMost(1.0)),
    ("gelu_tanh_1m", "us", Goal::AtMost(1.0)),
    ("sdpa_causal", "us", Goal::AtMost(1.0)),
];

/// Steps and threads of the `gpt_train_2_threads` row.
const TRAIN_STEPS: usize = 200;
const TRAIN_THREADS: usize = 2;

/// The release build of `gpt_distributed`, the program the training row runs.
fn gpt_program() -> Result<std::path::PathBuf, String> {
    run_capture(Command::new("cargo").args([
        "build",
        "--release",
        "-p",
        GPT_BENCH_PACKAGE,
        "--example",
        "gpt_distributed",
    ]))?;
    Ok(crate::process::target_dir().join("release/examples/gpt_distributed"))
}

/// One timed single-process training run of ours: its wall time in seconds.
fn our_training(program: &Path) -> Result<Metric, String> {
    let o = run_capture(Command::new(program).args([
        "--single-process",
        "--threads",
        &TRAIN_THREADS.to_string(),
        "--steps",
        &TRAIN_STEPS.to_string(),
        "--sample",
        "0",
    ]))?;
    print!("{o}");
    let value = parse_train_seconds(&o)
        .ok_or_else(|| format!("no single-process wall time in gpt_distributed's output:\n{o}"))?;
    Ok(Metric {
        key: "gpt_train_2_threads".into(),
        value,
        unit: "s".into(),
    })
}

/// `cargo bench` of one of our benches (`--no-run`: build only).
fn cargo_bench(package: &str, bench: &str, build_only: bool) -> Result<String, String> {
    let mut c = Command::new("cargo");
    c.args(["bench", "-p", package, "--bench", bench]);
    if build_only {
        c.arg("--no-run");
    }
    run_capture(&mut c)
}

pub(crate) fn run(args: &Args) -> Result<(), String> {
    super::cpu::print_cpu();
    let Common { anchor, rounds } = &args.common;
    let python = anchor.python();
    let core = torch_with(python.clone(), &anchor.anchors.join("torch_core_step.py"));
    // the GPT step's twin lives in this repository (the model and data are ours)
    let gpt_script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../benchmarks/torch_gpt.py");
    let gpt = torch_with(python.clone(), &gpt_script);
    let ops = torch_with(python.clone(), &anchor.anchors.join("torch_ops_step.py"));
    let bf16 = torch_with(python, &anchor.anchors.join("torch_bf16_step.py"));
    // build once, outside the timed runs
    cargo_bench("tensorplay-core", "core_step", true)?;
    cargo_bench(GPT_BENCH_PACKAGE, "gpt_step", true)?;
    cargo_bench("tensorplay-core", "ops_step", true)?;
    let program = gpt_program()?;
    let mut ours: Vec<Metric> = Vec::new();
    let mut theirs: Vec<Metric> = Vec::new();
    let mut torch_ran = false;
    let mut last_failure = None;
    for r in 1..=*rounds {
        eprintln!("round {r}: tensorplay");
        for (package, bench) in [
            ("tensorplay-core", "core_step"),
            (GPT_BENCH_PACKAGE, "gpt_step"),
            ("tensorplay-core", "ops_step"),
        ] {
            let o = cargo_bench(package, bench, false)?;
            print!("{o}");
            ours.extend(parse_core(&o));
        }
        ours.push(our_training(&program)?);
        if core.is_ok() || gpt.is_ok() || ops.is_ok() || bf16.is_ok() {
            eprintln!("round {r}: pytorch");
        }
        type Parse = fn(&str) -> Vec<Metric>;
        // torch_bf16_step.py's first argument is its thread count (one, as OMP_NUM_THREADS)
        let anchors: [(_, Vec<String>, &[&str], Parse); 4] = [
            (&core, vec![], &["torch-core "], parse_core),
            (&gpt, vec!["step".to_string()], &["torch-core "], parse_core),
            (&ops, vec![], &["torch-ops "], parse_core),
            (&bf16, vec!["1".to_string()], &["torch-bf16 "], parse_bf16),
        ];
        for (found, args, keep, parse) in anchors {
            let Ok((python, script)) = found else {
                continue;
            };
            let t = match run_torch(python, script, &args, r, keep) {
                Ok(t) => {
                    torch_ran = true;
                    t
                }
                Err((kept, why)) => {
                    last_failure = Some(why);
                    kept
                }
            };
            print!("{t}");
            theirs.extend(parse(&t));
        }
        if let Ok((python, script)) = &gpt {
            let args = ["train".to_string(), TRAIN_STEPS.to_string()];
            match run_torch_threads(python, script, &args, r, &["pytorch:"], TRAIN_THREADS) {
                Ok(t) => {
                    print!("{t}");
                    theirs.extend(parse_train_seconds(&t).map(|value| Metric {
                        key: "gpt_train_2_threads".into(),
                        value,
                        unit: "s".into(),
                    }));
                }
                Err((_, why)) => last_failure = Some(why),
            }
        }
    }
    let pytorch = match (&core, &gpt, torch_ran, last_failure) {
        (Err(why), Err(_), _, _) => Pytorch::Missing(why.clone()),
        (_, _, false, Some(why)) => Pytorch::Failed(why),
        _ => Pytorch::Ran,
    };
    let best_of = |runs: &[Metric], key: &str, unit: &str| {
        best(
            runs.iter()
                .filter(|m| m.key == key && m.unit == unit)
                .map(|m| m.value),
            higher_is_better(unit),
        )
    };
    let rows: Vec<Row> = ROWS
        .iter()
        .map(|&(key, unit, goal)| {
            Row::new(
                key,
                unit,
                best_of(&ours, key, unit),
                best_of(&theirs, key, unit),
                goal,
            )
        })
        .collect();
    print_summary(
        &format!(
            "best of {rounds} round(s), one thread each (gpt_train_2_threads: {TRAIN_THREADS})"
        ),
        &rows,
        &pytorch,
    );
    Ok(())
}
