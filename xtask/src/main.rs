//! `cargo xtask <command>`: project automation.
//!
//! - `test-multigpu`: runs the multi-rank test scenarios, one process per rank: with `nccl` on
//!   every GPU count up to the number of GPUs when there are GPUs, and with the `cpu` backend at
//!   world sizes 2 to 4 always; then the differentiable collectives' test suites and the
//!   conformance vectors (cpu, and nccl with GPUs). Ends with `N passed, M failed`.
//! - `test-multihost [--filter TEXT]`: K simulated hosts in network namespaces (see
//!   `multihost.rs`), the multi-process tests and the main job spread over them. Needs root.
//! - `gpu-check [--bundle DIR]`: the GPU check as a bundle of prebuilt binaries and `run.sh`
//!   for a GPU machine without a toolchain, or built and run here (see `gpu_check.rs`).
//! - `check-kernels`: the CUDA kernels without a GPU: the host emulation's tests, then every
//!   kernel compiled by NVRTC and assembled by ptxas of CUDA 12.9 and 13.5 (see
//!   `check_kernels.rs`).
//! - `conformance --vectors FILE [--backend nccl]`: runs a conformance vectors file against the
//!   differentiable collectives (`crates/tensorplay-conformance`).
//! - `bench-collectives`: the cpu backend's collective bandwidth next to PyTorch gloo's
//!   (`--hosts K`: across K simulated hosts, next to one host's).
//! - `bench-ddp`: one `DistributedDataParallel` training step (our `bench_ddp` example, cpu
//!   backend) and PyTorch's `torch_ddp_step.py` (DDP over gloo) in the same run, alternately for
//!   `--rounds` rounds; prints both sides' local step, DDP step and overhead with the median
//!   ratios (ours / PyTorch's) against the goals, and our hidden fraction and exposed wait.
//! - `bench-core`: runs the core benchmark (`cargo bench -p tensorplay-core --bench core_step`)
//!   and PyTorch's anchor script `torch_core_step.py` in one run on this machine, then the GPT
//!   training step of `gpt_distributed` (`cargo bench -p tensorplay-examples --bench gpt_step`) beside
//!   `benchmarks/torch_gpt.py step`, and prints both sides with the ratios (ours / PyTorch's
//!   time; ours / PyTorch's GFLOP/s).
//! - `bench-rpc`: the RPC benchmark (`tensorplay-rpc`'s `bench_rpc` example) and PyTorch's
//!   `torch_rpc_latency.py` (TensorPipe) alternately for several rounds, then the best round of
//!   each with the ratios (ours / PyTorch's, for every metric; the goal column says which way
//!   is better).

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use clap::{Parser, Subcommand};

mod check_docs;
mod check_kernels;
mod gpu_check;
mod multihost;
mod resume;

#[derive(Parser)]
#[command(name = "xtask", about = "tensorplay project automation")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

/// Where PyTorch's anchor scripts and interpreter are (shared by the benchmark commands).
#[derive(clap::Args)]
struct Anchor {
    /// Folder holding the PyTorch anchor scripts.
    #[arg(long, default_value = "../shared/anchors")]
    anchors: PathBuf,
    /// Python interpreter with PyTorch installed. Without it: `ANCHOR_PYTHON`, then
    /// `$ANCHOR_VENV/bin/python`, then the interpreter that `bash <anchors>/setup.sh` prints
    /// (it installs PyTorch once into a virtual environment and is idempotent).
    #[arg(long, env = "ANCHOR_PYTHON")]
    python: Option<PathBuf>,
}

impl Anchor {
    /// The PyTorch interpreter: `--python`, `ANCHOR_PYTHON`, `$ANCHOR_VENV/bin/python`, then
    /// what `bash <anchors>/setup.sh` prints on its last line. When setup.sh is missing or
    /// fails, a path that does not exist is returned and the benchmarks report ours only.
    fn python(&self) -> PathBuf {
        if let Some(p) = &self.python {
            return p.clone();
        }
        if let Some(v) = std::env::var_os("ANCHOR_VENV") {
            return PathBuf::from(v).join("bin/python");
        }
        let setup = self.anchors.join("setup.sh");
        if !setup.exists() {
            eprintln!("note: {} not found", setup.display());
            return PathBuf::from("python-with-torch-not-found");
        }
        eprintln!(
            "finding PyTorch with `bash {}` (installs it once)...",
            setup.display()
        );
        match Command::new("bash").arg(&setup).output() {
            Ok(out) if out.status.success() => {
                let text = String::from_utf8_lossy(&out.stdout);
                match text.lines().rev().find(|l| !l.trim().is_empty()) {
                    Some(l) => PathBuf::from(l.trim()),
                    None => PathBuf::from("python-with-torch-not-found"),
                }
            }
            Ok(out) => {
                eprintln!(
                    "note: {} failed ({}): {}",
                    setup.display(),
                    out.status,
                    String::from_utf8_lossy(&out.stderr).trim()
                );
                PathBuf::from("python-with-torch-not-found")
            }
            Err(e) => {
                eprintln!("note: could not run {}: {e}", setup.display());
                PathBuf::from("python-with-torch-not-found")
            }
        }
    }
}

#[derive(Subcommand)]
enum Cmd {
    /// Multi-rank test scenarios (real processes over 127.0.0.1; NCCL where GPUs exist).
    TestMultigpu,
    /// Multi-host scenarios: K simulated hosts on this machine (network, mount and UTS
    /// namespaces, veth pairs to a bridge, private addresses inside the namespaces only), the
    /// project's multi-process tests and the main job started by `tensorplay-run --nnodes K` on
    /// each; ends with `N passed, M failed`. Needs root.
    TestMultihost {
        /// Only the scenarios whose name contains this.
        #[arg(long)]
        filter: Option<String>,
    },
    /// The main job killed and restarted: `tensorplay-run --max-restarts 2` runs
    /// `wine_distributed` with checkpoints while a rank SIGKILLs itself once, in each run in
    /// turn; the result lines must equal an uninterrupted job's.
    TestResume,
    /// Collective bandwidth (2 ranks, 4 KiB to 64 MiB) next to PyTorch gloo's.
    BenchCollectives {
        #[command(flatten)]
        anchor: Anchor,
        /// Number of ranks.
        #[arg(long, default_value_t = 2)]
        world: usize,
        /// Largest size in MiB.
        #[arg(long, default_value_t = 64)]
        max_mib: usize,
        /// Instead: the table with its ranks spread over this many simulated hosts (network
        /// namespaces, TCP over veth between them; needs root), next to one host's with the
        /// same number of ranks. 0: one host, next to PyTorch gloo.
        #[arg(long, default_value_t = 0)]
        hosts: usize,
        /// Ranks per simulated host (with --hosts).
        #[arg(long, default_value_t = 1)]
        per_host: usize,
        /// Instead: the flight recorder's cost, this many rounds alternating
        /// `TENSORPLAY_FR_BUFFER_SIZE=0` and the default (4 KiB collectives, 20000 calls each, best round each).
        #[arg(long, default_value_t = 0)]
        fr_rounds: usize,
    },
    /// DistributedDataParallel training step (MLP 784-hidden-hidden-hidden-10, batch 32 per
    /// rank) next to PyTorch DDP over gloo: local step, DDP step, overhead and their ratios.
    BenchDdp {
        #[command(flatten)]
        anchor: Anchor,
        /// Number of ranks.
        #[arg(long, default_value_t = 2, value_parser = at_least_one())]
        world: usize,
        /// Width of the three hidden layers.
        #[arg(long, default_value_t = 1024, value_parser = at_least_one())]
        hidden: usize,
        /// Timed steps of each phase (after 5 warm-up steps); the median is reported.
        #[arg(long, default_value_t = 30, value_parser = at_least_one())]
        steps: usize,
        /// How many times to alternate the two programs; the summary gives the median of the
        /// rounds' ratios.
        #[arg(long, default_value_t = 1, value_parser = at_least_one())]
        rounds: usize,
    },
    /// Runs a conformance vectors file against the differentiable collectives (one world of
    /// processes per world size in the file); ends with `N passed, M failed`.
    Conformance {
        /// The vectors file (format: conformance/README.md).
        #[arg(long)]
        vectors: PathBuf,
        /// Process-group backend: "cpu", or "nccl" on a GPU machine.
        #[arg(long, default_value = "cpu")]
        backend: String,
        /// Timeout of each collective, in seconds.
        #[arg(long, default_value_t = 30)]
        timeout: u64,
    },
    /// Core benchmark side by side with PyTorch (MLP training step, f32 matmul GFLOP/s).
    BenchCore {
        #[command(flatten)]
        anchor: Anchor,
        /// How many times to alternate the two programs (the machines are noisy).
        #[arg(long, default_value_t = 5)]
        rounds: usize,
    },
    /// RPC latency, calls/s and tensor echo throughput (2 workers on 127.0.0.1) next to
    /// PyTorch's TensorPipe.
    BenchRpc {
        #[command(flatten)]
        anchor: Anchor,
        /// How many times to alternate the two programs (the machines are noisy).
        #[arg(long, default_value_t = 3)]
        rounds: usize,
    },
    /// The CUDA kernels without a GPU: their host emulation against the CPU's operations, then
    /// NVRTC and ptxas of CUDA 12.9 and 13.5 (NVIDIA's PyPI wheels, fetched once into
    /// `target/nvidia-wheels`) compile and assemble every kernel for sm_80 and sm_90 (12.9), sm_90 and sm_100 (13.5).
    CheckKernels,
    /// Checks the rendered facade docs (`target/doc/tensorplay/`, from `cargo doc --workspace
    /// --no-deps`): no example names an internal crate, no prose shows a broken
    /// `[tensorplay_...` link.
    CheckDocs,
    /// The GPU check: builds `tensorplay-gpu-check` and a `run.sh` into `--bundle DIR` (under
    /// 64 MiB, no toolchain needed where it runs), or builds and runs it here. Without a GPU it
    /// says so and fails; it never reports checks that did not run as passed.
    GpuCheck {
        /// Only build the bundle into this folder.
        #[arg(long)]
        bundle: Option<PathBuf>,
    },
}

/// One measured line: a key such as `mlp_step` and its value with unit.
#[derive(Debug, Clone)]
struct Metric {
    key: String,
    value: f64,
    unit: String,
}

/// Parses lines like `<prefix> mlp_step batch64   123.4 us/step` and
/// `<prefix> matmul 512^3 f32   80.1 GFLOP/s`.
fn parse_metrics(text: &str) -> Vec<Metric> {
    let mut out = Vec::new();
    for line in text.lines() {
        let toks: Vec<&str> = line.split_whitespace().collect();
        if toks.len() < 4 {
            continue;
        }
        let unit = toks[toks.len() - 1];
        if unit != "us/step" && unit != "GFLOP/s" {
            continue;
        }
        let Ok(value) = toks[toks.len() - 2].parse::<f64>() else {
            continue;
        };
        let key = toks[1..toks.len() - 2].join(" ");
        out.push(Metric {
            key,
            value,
            unit: unit.to_string(),
        });
    }
    out
}

fn run_capture(cmd: &mut Command) -> Result<String, String> {
    let out = cmd
        .output()
        .map_err(|e| format!("could not start {cmd:?}: {e}"))?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    if !out.status.success() {
        return Err(format!(
            "{cmd:?} failed ({}):\n{}\n{}",
            out.status,
            stdout,
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(stdout)
}

/// The best of the rounds: the least time, or the most GFLOP/s. On a shared, noisy machine
/// interference only ever slows a run down, so the best round is the least disturbed one; both
/// programs are treated alike.
fn best(v: &[f64], unit: &str) -> f64 {
    let it = v.iter().copied();
    if unit == "us/step" {
        it.fold(f64::INFINITY, f64::min)
    } else {
        it.fold(0.0, f64::max)
    }
}

fn bench_core(anchors: &Path, python: &Path, rounds: usize) -> Result<(), String> {
    let script = anchors.join("torch_core_step.py");
    let have_torch = script.exists() && python.exists();
    if !have_torch {
        eprintln!(
            "note: PyTorch anchor not found ({} / {}); run `bash ../shared/anchors/setup.sh` \
             to compare side by side. Reporting tensorplay only.",
            script.display(),
            python.display()
        );
    }
    // the GPT step's twin lives in this repository (the model and data are ours)
    let gpt_script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../benchmarks/torch_gpt.py");
    // build once, outside the timed runs
    run_capture(Command::new("cargo").args([
        "bench",
        "-p",
        "tensorplay-core",
        "--bench",
        "core_step",
        "--no-run",
    ]))?;
    run_capture(Command::new("cargo").args([
        "bench",
        "-p",
        "tensorplay-examples",
        "--bench",
        "gpt_step",
        "--no-run",
    ]))?;
    let mut ours: Vec<Vec<Metric>> = Vec::new();
    let mut theirs: Vec<Vec<Metric>> = Vec::new();
    let mut gpt_theirs: Vec<Vec<Metric>> = Vec::new();
    for r in 0..rounds.max(1) {
        eprintln!("round {}: tensorplay", r + 1);
        let o = run_capture(Command::new("cargo").args([
            "bench",
            "-p",
            "tensorplay-core",
            "--bench",
            "core_step",
        ]))?;
        print!("{o}");
        let mut metrics = parse_metrics(&o);
        let g = run_capture(Command::new("cargo").args([
            "bench",
            "-p",
            "tensorplay-examples",
            "--bench",
            "gpt_step",
        ]))?;
        print!("{g}");
        metrics.extend(parse_metrics(&g));
        ours.push(metrics);
        if have_torch && python.exists() {
            let g = run_capture(
                Command::new(python)
                    .arg(&gpt_script)
                    .arg("step")
                    .env("OMP_NUM_THREADS", "1"),
            )?;
            print!("{g}");
            gpt_theirs.push(parse_metrics(&g));
        }
        if have_torch {
            eprintln!("round {}: pytorch", r + 1);
            // PyTorch's RemoteModule sometimes fails on the worker ("No module named
            // '_remote_module_non_scriptable'"): keep the lines it printed before failing
            let t = match run_capture(
                Command::new(python)
                    .arg(&script)
                    .env("OMP_NUM_THREADS", "1"),
            ) {
                Ok(t) => t,
                Err(e) => {
                    let last = e.lines().rev().find(|l| l.contains("Error")).unwrap_or("");
                    eprintln!("note: the PyTorch anchor failed in round {}: {last}", r + 1);
                    e.lines()
                        .filter(|l| l.starts_with("torch-rpc "))
                        .map(|l| format!("{l}\n"))
                        .collect()
                }
            };
            print!("{t}");
            let mut t = parse_metrics(&t);
            t.extend(gpt_theirs.last().cloned().unwrap_or_default());
            theirs.push(t);
        }
    }
    println!();
    println!(
        "{:<24} {:>14} {:>14} {:>10}  goal",
        "metric (best round)", "tensorplay", "pytorch", "ratio"
    );
    let keys: Vec<(String, String)> = ours[0]
        .iter()
        .map(|m| (m.key.clone(), m.unit.clone()))
        .collect();
    for (key, unit) in keys {
        let a: Vec<f64> = ours
            .iter()
            .flat_map(|v| v.iter().filter(|m| m.key == key).map(|m| m.value))
            .collect();
        let a = best(&a, &unit);
        let b: Vec<f64> = theirs
            .iter()
            .flat_map(|v| v.iter().filter(|m| m.key == key).map(|m| m.value))
            .collect();
        if b.is_empty() {
            println!("{key:<24} {a:>10.1} {unit}");
            continue;
        }
        let b = best(&b, &unit);
        let (ratio, goal) = if key.starts_with("gpt_step") {
            (a / b, "time ratio <= 0.7")
        } else if unit == "us/step" {
            (a / b, "time ratio <= 0.5")
        } else {
            (a / b, "GFLOP/s ratio >= 0.8")
        };
        println!("{key:<24} {a:>10.1} {unit:<4} {b:>10.1} {unit:<4} {ratio:>8.3}  {goal}");
    }
    Ok(())
}

/// Number of NVIDIA GPUs (`nvidia-smi -L`), 0 when there is no driver.
fn gpu_count() -> usize {
    Command::new("nvidia-smi")
        .arg("-L")
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map_or(0, |o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .filter(|l| l.starts_with("GPU "))
                .count()
        })
}

const CPU_SCENARIOS: &[&str] = &[
    "world_size_1_is_identity",
    "world_size_2",
    "world_size_3",
    "world_size_4_with_subgroups",
    "mismatched_shapes_are_an_error_on_every_rank",
    "bad_arguments_are_clear_errors",
    "a_dead_rank_is_reported_not_a_hang",
    "a_rank_that_never_joins_times_out",
];

fn test_multigpu() -> Result<(), String> {
    run_capture(Command::new("cargo").args([
        "test",
        "-p",
        "tensorplay-collectives",
        "--test",
        "multiprocess",
        "--no-run",
    ]))?;
    let mut scenarios: Vec<(String, Vec<(String, String)>)> = CPU_SCENARIOS
        .iter()
        .map(|s| (s.to_string(), vec![]))
        .collect();
    let gpus = gpu_count();
    for n in 1..=gpus {
        scenarios.push((
            "nccl_world".to_string(),
            vec![("TENSORPLAY_TEST_NCCL_WORLD".into(), n.to_string())],
        ));
    }
    if gpus == 0 {
        println!("no GPU found: running the cpu-backend scenarios only");
    }
    let (mut passed, mut failed) = (0, 0);
    for (name, env) in &scenarios {
        let label = if env.is_empty() {
            name.clone()
        } else {
            format!(
                "{name} {}",
                env.iter()
                    .map(|(k, v)| format!("{k}={v}"))
                    .collect::<Vec<_>>()
                    .join(" ")
            )
        };
        let out = Command::new("cargo")
            .args([
                "test",
                "-q",
                "-p",
                "tensorplay-collectives",
                "--test",
                "multiprocess",
                "--",
                "--exact",
                name,
            ])
            .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .output()
            .map_err(|e| format!("could not run cargo: {e}"))?;
        let text = String::from_utf8_lossy(&out.stdout);
        if out.status.success() && text.contains("1 passed") {
            passed += 1;
            println!("ok     {label}");
        } else {
            failed += 1;
            println!(
                "FAILED {label}\n{text}\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
    // the differentiable collectives: their multi-process test suites and the conformance
    // vectors (cpu backend; nccl too where there are GPUs)
    let mut suites: Vec<(String, Command)> = vec![];
    let mut tests = Command::new("cargo");
    tests.args(["test", "-q", "-p", "tensorplay-distributed-nn", "--tests"]);
    suites.push(("tensorplay-distributed-nn tests".into(), tests));
    let mut backends = vec!["cpu"];
    if gpus > 0 {
        backends.push("nccl");
    }
    for file in [
        "conformance/functional-w2.json",
        "conformance/functional-subgroup-w3.json",
    ] {
        for backend in &backends {
            let mut c = Command::new("cargo");
            c.args([
                "run",
                "-q",
                "-p",
                "tensorplay-conformance",
                "--",
                "--vectors",
                file,
            ])
            .args(["--backend", backend]);
            suites.push((format!("conformance {file} --backend {backend}"), c));
        }
    }
    for (label, mut cmd) in suites {
        let out = cmd
            .env("TENSORPLAY_SPAWN_VERBOSE", "0")
            .output()
            .map_err(|e| format!("could not run cargo: {e}"))?;
        if out.status.success() {
            passed += 1;
            println!("ok     {label}");
        } else {
            failed += 1;
            println!(
                "FAILED {label}\n{}\n{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
    println!("{passed} passed, {failed} failed");
    if failed > 0 {
        return Err(format!("{failed} scenario(s) failed"));
    }
    Ok(())
}

/// Parses `<prefix> <name> <bytes> B <us> us algbw <x> GB/s busbw <y> GB/s` into
/// ((name, bytes), (us, busbw)).
fn parse_coll(text: &str) -> Vec<((String, u64), (f64, f64))> {
    text.lines()
        .filter_map(|l| {
            let t: Vec<&str> = l.split_whitespace().collect();
            if t.len() < 12 || t[3] != "B" || t[5] != "us" {
                return None;
            }
            Some((
                (t[1].to_string(), t[2].parse().ok()?),
                (t[4].parse().ok()?, t[10].parse().ok()?),
            ))
        })
        .collect()
}

fn bench_collectives(
    anchors: &Path,
    python: &Path,
    world: usize,
    max_mib: usize,
) -> Result<(), String> {
    run_capture(Command::new("cargo").args([
        "build",
        "--release",
        "-q",
        "-p",
        "tensorplay-collectives",
        "--example",
        "bench_collectives",
    ]))?;
    eprintln!("running tensorplay (cpu backend)");
    let ours = run_capture(
        Command::new("cargo")
            .args([
                "run",
                "--release",
                "-q",
                "-p",
                "tensorplay-collectives",
                "--example",
                "bench_collectives",
                "--",
            ])
            .arg(world.to_string())
            .arg(max_mib.to_string()),
    )?;
    print!("{ours}");
    let script = anchors.join("torch_gloo_collectives.py");
    let theirs = if script.exists() && python.exists() {
        eprintln!("running PyTorch gloo");
        let t = run_capture(
            Command::new(python)
                .arg(&script)
                .arg(world.to_string())
                .arg(max_mib.to_string()),
        )?;
        print!("{t}");
        parse_coll(&t)
    } else {
        eprintln!(
            "note: PyTorch anchor not found ({}); tensorplay only",
            python.display()
        );
        vec![]
    };
    let memcpy = memcpy_gbps(64);
    println!();
    println!("memcpy 1 thread {memcpy:.2} GB/s");
    println!(
        "{:<15} {:>10}  {:>10} {:>10} {:>7}  {:>9} {:>9} {:>7} {:>8}",
        "collective", "bytes", "us", "gloo_us", "t_ratio", "busbw", "gloo", "bw_x", "memcpy_x"
    );
    for ((name, bytes), (us, bw)) in parse_coll(&ours) {
        let mx = bw / memcpy;
        match theirs.iter().find(|(k, _)| k.0 == name && k.1 == bytes) {
            Some((_, (tus, tbw))) => println!(
                "{name:<15} {bytes:>10}  {us:>10.1} {tus:>10.1} {:>7.2}  {bw:>9.3} {tbw:>9.3} {:>7.2} {mx:>8.2}",
                us / tus,
                if *tbw > 0.0 { bw / tbw } else { f64::NAN }
            ),
            None => println!(
                "{name:<15} {bytes:>10}  {us:>10.1} {:>10} {:>7}  {bw:>9.3} {:>9} {:>7} {mx:>8.2}",
                "-", "-", "-", "-"
            ),
        }
    }
    Ok(())
}

/// The flight recorder's cost: the 4 KiB collectives of `bench_collectives` (20000 iterations
/// each), alternately with the recorder off (`TENSORPLAY_FR_BUFFER_SIZE=0`) and on (the
/// default), for `rounds` rounds; prints the best round of each and the ratios (goal: the
/// 4 KiB all_reduce at most 3% slower with it on).
fn bench_flight_recorder(world: usize, rounds: usize) -> Result<(), String> {
    run_capture(Command::new("cargo").args([
        "build",
        "--release",
        "-q",
        "-p",
        "tensorplay-collectives",
        "--example",
        "bench_collectives",
    ]))?;
    let mut best: [Vec<((String, u64), f64)>; 2] = [Vec::new(), Vec::new()];
    for round in 0..rounds {
        for (i, size) in ["0", "2000"].iter().enumerate() {
            let out = run_capture(
                Command::new("cargo")
                    .args([
                        "run",
                        "--release",
                        "-q",
                        "-p",
                        "tensorplay-collectives",
                        "--example",
                        "bench_collectives",
                        "--",
                    ])
                    .arg(world.to_string())
                    .arg("0")
                    .env("TENSORPLAY_FR_BUFFER_SIZE", size)
                    .env("TENSORPLAY_BENCH_ITERS", "20000"),
            )?;
            for (k, (us, _)) in parse_coll(&out) {
                match best[i].iter_mut().find(|(b, _)| *b == k) {
                    Some((_, b)) => *b = b.min(us),
                    None => best[i].push((k, us)),
                }
            }
        }
        eprintln!("round {} of {rounds} done", round + 1);
    }
    println!("flight recorder cost, best of {rounds} rounds, {world} ranks (us per call)");
    println!(
        "{:<15} {:>8} {:>10} {:>10} {:>7}",
        "collective", "bytes", "off_us", "on_us", "on/off"
    );
    let mut all_reduce = None;
    for ((name, bytes), off) in &best[0] {
        if let Some((_, on)) = best[1].iter().find(|(k, _)| k.0 == *name && k.1 == *bytes) {
            println!(
                "{name:<15} {bytes:>8} {off:>10.2} {on:>10.2} {:>7.3}",
                on / off
            );
            if name == "all_reduce" {
                all_reduce = Some(on / off);
            }
        }
    }
    if let Some(r) = all_reduce {
        println!(
            "4 KiB all_reduce with the recorder on: {r:.3}x (goal <= 1.03: {})",
            if r <= 1.03 { "met" } else { "missed" }
        );
    }
    Ok(())
}

/// Single-thread memcpy bandwidth in GB/s (bytes copied / time), as
/// `../shared/anchors/memcpy_limit.py` measures it: `mib` MiB of float32 into another buffer,
/// best of 20, after one warm-up copy that faults the pages in.
fn memcpy_gbps(mib: usize) -> f64 {
    let n = mib << 18;
    let a = vec![1.0f32; n];
    let mut b = vec![0.0f32; n];
    b.copy_from_slice(&a);
    let best = (0..20)
        .map(|_| {
            let t = std::time::Instant::now();
            b.copy_from_slice(std::hint::black_box(&a));
            std::hint::black_box(&b);
            t.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min);
    (mib << 20) as f64 / best / 1e9
}

/// Parses the lines both RPC benchmarks print (the prefix differs):
/// `<p> rpc_sync small  p50 X us  p99 Y us`, `<p> rpc_async small  X calls/s (5000 in flight)`,
/// `<p> echo N MiB  X ms/round trip  Y GB/s`, `<p> remote+to_here   p50 X us`,
/// `<p> RemoteModule Linear(16,8) forward  p50 X us`.
fn parse_rpc(text: &str) -> Vec<Metric> {
    let mut out = Vec::new();
    let mut push = |key: String, value: Option<f64>, unit: &str| {
        if let Some(value) = value {
            out.push(Metric {
                key,
                value,
                unit: unit.to_string(),
            });
        }
    };
    for line in text.lines() {
        let t: Vec<&str> = line.split_whitespace().collect();
        let num = |i: usize| t.get(i).and_then(|s| s.parse::<f64>().ok());
        match t.get(1..3) {
            Some(["rpc_sync", "small"]) if t.len() >= 9 => {
                push("rpc_sync small p50".into(), num(4), "us");
                push("rpc_sync small p99".into(), num(7), "us");
            }
            Some(["rpc_async", "small"]) if t.len() >= 5 => {
                push("rpc_async 5000 in flight".into(), num(3), "calls/s");
            }
            Some(["echo", n]) if t.len() >= 9 && t[3] == "MiB" => {
                push(format!("echo {n} MiB"), num(7), "GB/s");
            }
            Some(["remote+to_here", "p50"]) if t.len() >= 5 => {
                push("remote+to_here p50".into(), num(3), "us");
            }
            Some(["RemoteModule", "Linear(16,8)"]) if t.len() >= 7 => {
                push("RemoteModule Linear fwd p50".into(), num(5), "us");
            }
            _ => {}
        }
    }
    out
}

fn bench_rpc(anchors: &Path, python: &Path, rounds: usize) -> Result<(), String> {
    let script = anchors.join("torch_rpc_latency.py");
    let have_torch = script.exists() && python.exists();
    if !have_torch {
        eprintln!(
            "note: PyTorch anchor not found ({} / {}); run `bash ../shared/anchors/setup.sh` \
             to compare side by side. Reporting tensorplay only.",
            script.display(),
            python.display()
        );
    }
    let args = [
        "-q",
        "--release",
        "-p",
        "tensorplay-rpc",
        "--example",
        "bench_rpc",
    ];
    let rm_args = [
        "-q",
        "--release",
        "-p",
        "tensorplay-remote-module",
        "--example",
        "bench_remote_module",
    ];
    // build once, outside the timed runs
    run_capture(Command::new("cargo").arg("build").args(args))?;
    run_capture(Command::new("cargo").arg("build").args(rm_args))?;
    let mut ours: Vec<Vec<Metric>> = Vec::new();
    let mut theirs: Vec<Vec<Metric>> = Vec::new();
    for r in 0..rounds.max(1) {
        eprintln!("round {}: tensorplay", r + 1);
        let mut o = run_capture(Command::new("cargo").arg("run").args(args))?;
        o.push_str(&run_capture(
            Command::new("cargo").arg("run").args(rm_args),
        )?);
        print!("{o}");
        ours.push(parse_rpc(&o));
        if have_torch {
            eprintln!("round {}: pytorch", r + 1);
            let t = run_capture(
                Command::new(python)
                    .arg(&script)
                    .env("OMP_NUM_THREADS", "1"),
            )?;
            print!("{t}");
            theirs.push(parse_rpc(&t));
        }
    }
    let best_of = |runs: &[Vec<Metric>], key: &str, unit: &str| -> Option<f64> {
        let v: Vec<f64> = runs
            .iter()
            .flat_map(|v| v.iter().filter(|m| m.key == key).map(|m| m.value))
            .collect();
        (!v.is_empty()).then(|| best(&v, if unit == "us" { "us/step" } else { unit }))
    };
    println!();
    println!(
        "best of {} rounds; ratio = tensorplay / PyTorch for every metric",
        rounds.max(1)
    );
    println!(
        "{:<26} {:>16} {:>16} {:>8}  goal",
        "metric", "tensorplay", "pytorch", "ratio"
    );
    let keys: Vec<(String, String)> = ours
        .iter()
        .flatten()
        .map(|m| (m.key.clone(), m.unit.clone()))
        .fold(Vec::new(), |mut acc, k| {
            if !acc.contains(&k) {
                acc.push(k);
            }
            acc
        });
    for (key, unit) in keys {
        let Some(a) = best_of(&ours, &key, &unit) else {
            continue;
        };
        let goal = match unit.as_str() {
            "us" if key.ends_with("p50")
                && (key.starts_with("rpc_sync") || key.starts_with("RemoteModule")) =>
            {
                Some((0.5, "<= 0.5 (time: lower is better)"))
            }
            "us" => None,
            "calls/s" => Some((2.0, ">= 2 (rate: higher is better)")),
            _ => Some((1.0, ">= 1 (GB/s: higher is better)")),
        };
        match best_of(&theirs, &key, &unit) {
            Some(b) if b > 0.0 => {
                let ratio = a / b;
                let verdict = match goal {
                    Some((g, text)) => {
                        let met = if unit == "us" { ratio <= g } else { ratio >= g };
                        format!("{text} {}", if met { "met" } else { "MISSED" })
                    }
                    None if unit == "us" => "(time: lower is better)".into(),
                    None => String::new(),
                };
                let p = if unit == "GB/s" { 3 } else { 1 };
                println!(
                    "{key:<26} {a:>10.p$} {unit:<7} {b:>8.p$} {unit:<7} {ratio:>8.3}  {verdict}"
                );
            }
            _ => println!("{key:<26} {a:>10.1} {unit:<7}"),
        }
    }
    Ok(())
}

/// A clap parser of whole numbers >= 1 (bad values exit with code 2 and clap's message).
fn at_least_one() -> clap::builder::RangedU64ValueParser<usize> {
    clap::builder::RangedU64ValueParser::<usize>::new().range(1..)
}

/// What one run of a DDP benchmark printed (`<prefix>-ddp ...` lines; the prefix differs).
#[derive(Debug, Default, Clone, PartialEq)]
struct DdpRun {
    params: Option<u64>,
    grad_bytes: Option<u64>,
    buckets: Option<i64>,
    local_us: Option<f64>,
    ddp_us: Option<f64>,
    overhead_us: Option<f64>,
    hidden_fraction: Option<f64>,
    wait_us: Option<f64>,
    allreduce_us: Option<f64>,
}

/// One number of a [`DdpRun`], for the summary's rows.
type DdpField = fn(&DdpRun) -> Option<f64>;

/// The value, or `-` when it was not printed.
fn or_dash<T: std::fmt::Display>(v: Option<T>) -> String {
    v.map_or_else(|| "-".to_string(), |v| v.to_string())
}

/// Parses the lines both DDP benchmarks print: `<p> params N grad_bytes B buckets K`,
/// `<p> local step X us`, `<p> ddp step Y us`, `<p> overhead Z us`, and ours only:
/// `<p> hidden fraction F`, `<p> exposed wait W us`, `<p> all-reduce time T us ...`.
fn parse_ddp(text: &str) -> DdpRun {
    let mut r = DdpRun::default();
    for line in text.lines() {
        let t: Vec<&str> = line.split_whitespace().collect();
        if !t.first().is_some_and(|p| p.ends_with("-ddp")) {
            continue;
        }
        let num = |i: usize| t.get(i).and_then(|s| s.parse::<f64>().ok());
        let us = |i: usize| num(i).filter(|_| t.get(i + 1) == Some(&"us"));
        match t.get(1..3) {
            Some(["params", _]) if t.len() >= 7 => {
                r.params = t[2].parse().ok();
                r.grad_bytes = t[4].parse().ok();
                r.buckets = t[6].parse().ok();
            }
            Some(["local", "step"]) => r.local_us = us(3),
            Some(["ddp", "step"]) => r.ddp_us = us(3),
            Some(["overhead", _]) => r.overhead_us = us(2),
            Some(["hidden", "fraction"]) => r.hidden_fraction = num(3),
            Some(["exposed", "wait"]) => r.wait_us = us(3),
            Some(["all-reduce", "time"]) => r.allreduce_us = us(3),
            _ => {}
        }
    }
    r
}

/// The median of the values present (the mean of the two middle ones for an even count).
fn median(v: impl IntoIterator<Item = Option<f64>>) -> Option<f64> {
    let mut v: Vec<f64> = v.into_iter().flatten().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    Some(if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    })
}

/// `a / b` when both are known and `b > 0` (a ratio to a non-positive time means nothing).
fn ratio(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => Some(a / b),
        _ => None,
    }
}

fn bench_ddp(
    anchors: &Path,
    python: &Path,
    world: usize,
    hidden: usize,
    steps: usize,
    rounds: usize,
) -> Result<(), String> {
    let example = [
        "--release",
        "-q",
        "-p",
        "tensorplay-distributed-nn",
        "--example",
        "bench_ddp",
    ];
    let sizes = [world.to_string(), hidden.to_string(), steps.to_string()];
    run_capture(Command::new("cargo").arg("build").args(example))?;
    let script = anchors.join("torch_ddp_step.py");
    let have_torch = script.exists() && python.exists();
    if !have_torch {
        eprintln!(
            "note: PyTorch anchor not found ({} / {}); run `bash ../shared/anchors/setup.sh` \
             to compare side by side. Reporting tensorplay only.",
            script.display(),
            python.display()
        );
    }
    let mut ours: Vec<DdpRun> = Vec::new();
    let mut theirs: Vec<Option<DdpRun>> = Vec::new();
    for r in 0..rounds {
        eprintln!("round {}: running tensorplay (cpu backend)", r + 1);
        let o = run_capture(
            Command::new("cargo")
                .arg("run")
                .args(example)
                .arg("--")
                .args(&sizes),
        )?;
        print!("{o}");
        let parsed = parse_ddp(&o);
        if parsed.ddp_us.is_none() || parsed.local_us.is_none() {
            return Err(format!(
                "the bench_ddp example printed no step times in round {}:\n{o}",
                r + 1
            ));
        }
        ours.push(parsed);
        if have_torch {
            eprintln!("round {}: running PyTorch DDP (gloo)", r + 1);
            match run_capture(
                Command::new(python)
                    .arg(&script)
                    .args(&sizes)
                    .env("OMP_NUM_THREADS", "1"),
            ) {
                Ok(t) => {
                    print!("{t}");
                    theirs.push(Some(parse_ddp(&t)));
                }
                Err(e) => {
                    let last = e.lines().rev().find(|l| l.contains("Error")).unwrap_or("");
                    eprintln!("note: the PyTorch anchor failed in round {}: {last}", r + 1);
                    theirs.push(None);
                }
            }
        }
    }
    let pairs: Vec<(&DdpRun, &DdpRun)> = ours
        .iter()
        .zip(&theirs)
        .filter_map(|(o, t)| t.as_ref().map(|t| (o, t)))
        .collect();
    let theirs: Vec<&DdpRun> = theirs.iter().flatten().collect();
    let med = |runs: &[&DdpRun], f: DdpField| median(runs.iter().map(|r| f(r)));
    let ours: Vec<&DdpRun> = ours.iter().collect();
    let med_ratio = |f: DdpField| median(pairs.iter().map(|(o, t)| ratio(f(o), f(t))));
    let show = |v: Option<f64>, p: usize| v.map_or_else(|| "-".to_string(), |v| format!("{v:.p$}"));
    let first = ours.first().copied().cloned().unwrap_or_default();
    println!();
    println!(
        "world {world}, MLP 784-{hidden}-{hidden}-{hidden}-10, batch 32 per rank, float32, \
         {steps} timed steps; params {} grad_bytes {} buckets {} (PyTorch: {})",
        or_dash(first.params),
        or_dash(first.grad_bytes),
        or_dash(first.buckets),
        or_dash(theirs.first().and_then(|t| t.buckets))
    );
    println!(
        "median of {} round(s); ratio = tensorplay / PyTorch, the median of the rounds' ratios \
         ({} round(s) with both)",
        ours.len(),
        pairs.len()
    );
    println!(
        "{:<22} {:>12} {:>12} {:>8}",
        "metric", "tensorplay", "pytorch", "ratio"
    );
    let rows: [(&str, DdpField); 5] = [
        ("local step (us)", |r| r.local_us),
        ("ddp step (us)", |r| r.ddp_us),
        ("overhead (us)", |r| r.overhead_us),
        ("exposed wait (us)", |r| r.wait_us),
        ("all-reduce time (us)", |r| r.allreduce_us),
    ];
    for (name, f) in rows {
        println!(
            "{name:<22} {:>12} {:>12} {:>8}",
            show(med(&ours, f), 1),
            show(med(&theirs, f), 1),
            show(med_ratio(f), 3)
        );
    }
    println!(
        "{:<22} {:>12} {:>12}",
        "hidden fraction",
        show(med(&ours, |r| r.hidden_fraction), 3),
        "-"
    );
    println!();
    let verdict = |v: Option<f64>, goal: f64| match v {
        Some(v) if v <= goal => "met",
        Some(_) => "MISSED",
        None => "not measured",
    };
    if pairs.is_empty() {
        println!("no PyTorch run: ratios not measured");
    } else {
        let over = med_ratio(|r| r.overhead_us);
        let step = med_ratio(|r| r.ddp_us);
        println!(
            "overhead ratio (ours/torch) {}  goal <= 0.25 {}",
            show(over, 3),
            verdict(over, 0.25)
        );
        println!(
            "ddp step ratio (ours/torch) {}  goal <= 0.7 {}",
            show(step, 3),
            verdict(step, 0.7)
        );
        println!(
            "local step ratio (ours/torch) {}",
            show(med_ratio(|r| r.local_us), 3)
        );
    }
    println!(
        "hidden fraction (ours) {}",
        show(med(&ours, |r| r.hidden_fraction), 3)
    );
    Ok(())
}

/// Builds and runs the `tensorplay-conformance` program (in `crates/tensorplay-conformance`).
fn conformance(vectors: &Path, backend: &str, timeout: u64) -> Result<(), String> {
    // resolve the path before cargo changes directory
    let vectors = std::fs::canonicalize(vectors)
        .map_err(|e| format!("cannot read {}: {e}", vectors.display()))?;
    // the first build takes minutes: let cargo show it
    let built = Command::new("cargo")
        .args(["build", "-p", "tensorplay-conformance"])
        .status()
        .map_err(|e| format!("could not run cargo: {e}"))?;
    if !built.success() {
        return Err(format!("building tensorplay-conformance failed ({built})"));
    }
    let status = Command::new("cargo")
        .args(["run", "-q", "-p", "tensorplay-conformance", "--"])
        .arg("--vectors")
        .arg(&vectors)
        .args(["--backend", backend, "--timeout", &timeout.to_string()])
        .status()
        .map_err(|e| format!("could not run cargo: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("conformance failed ({status})"))
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let r = match cli.command {
        Cmd::TestMultigpu => test_multigpu(),
        Cmd::TestMultihost { filter } => multihost::test_multihost(filter.as_deref()),
        Cmd::TestResume => resume::test_resume(),
        Cmd::BenchCollectives {
            world, fr_rounds, ..
        } if fr_rounds > 0 => bench_flight_recorder(world, fr_rounds),
        Cmd::BenchCollectives {
            hosts,
            per_host,
            max_mib,
            ..
        } if hosts > 0 => multihost::bench_hosts(hosts, per_host, max_mib),
        Cmd::BenchCollectives {
            anchor,
            world,
            max_mib,
            ..
        } => bench_collectives(&anchor.anchors, &anchor.python(), world, max_mib),
        Cmd::BenchDdp {
            anchor,
            world,
            hidden,
            steps,
            rounds,
        } => bench_ddp(
            &anchor.anchors,
            &anchor.python(),
            world,
            hidden,
            steps,
            rounds,
        ),
        Cmd::BenchCore { anchor, rounds } => bench_core(&anchor.anchors, &anchor.python(), rounds),
        Cmd::BenchRpc { anchor, rounds } => bench_rpc(&anchor.anchors, &anchor.python(), rounds),
        Cmd::Conformance {
            vectors,
            backend,
            timeout,
        } => conformance(&vectors, &backend, timeout),
        Cmd::CheckDocs => check_docs::check_docs(),
        Cmd::CheckKernels => check_kernels::run(),
        Cmd::GpuCheck { bundle } => gpu_check::gpu_check(bundle.as_deref()),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_both_programs_lines() {
        let m = parse_metrics(
            "torch-core mlp_step batch64     151.2 us/step\n\
             torch-core matmul 512^3 f32      88.5 GFLOP/s\nnoise line\n",
        );
        assert_eq!(m.len(), 2);
        assert_eq!(m[0].key, "mlp_step batch64");
        assert_eq!(m[0].value, 151.2);
        assert_eq!(m[1].key, "matmul 512^3 f32");
        assert_eq!(m[1].unit, "GFLOP/s");
    }

    #[test]
    fn parses_the_ddp_lines_of_both_programs() {
        let text = "torch-ddp params 2913290 grad_bytes 11653160 buckets 2\n\
            torch-ddp local step    12000.5 us\n\
            torch-ddp ddp step      20000.0 us\n\
            torch-ddp overhead       7999.5 us\n\
            [rank 0] noise\n";
        let t = parse_ddp(text);
        assert_eq!(t.params, Some(2913290));
        assert_eq!(t.grad_bytes, Some(11653160));
        assert_eq!(t.buckets, Some(2));
        assert_eq!(t.local_us, Some(12000.5));
        assert_eq!(t.ddp_us, Some(20000.0));
        assert_eq!(t.overhead_us, Some(7999.5));
        assert_eq!(t.hidden_fraction, None);
        let o = parse_ddp(
            "tensorplay-ddp hidden fraction 0.875\n\
             tensorplay-ddp hidden fraction -\n\
             tensorplay-ddp exposed wait      310.2 us\n\
             tensorplay-ddp all-reduce time  2500.0 us (sum over buckets, 11653160 bytes)\n",
        );
        assert_eq!(o.hidden_fraction, None);
        assert_eq!(o.wait_us, Some(310.2));
        assert_eq!(o.allreduce_us, Some(2500.0));
        assert_eq!(
            parse_ddp("tensorplay-ddp hidden fraction 0.875\n").hidden_fraction,
            Some(0.875)
        );
        assert_eq!(median([Some(3.0), None, Some(1.0), Some(2.0)]), Some(2.0));
        assert_eq!(median([Some(1.0), Some(2.0)]), Some(1.5));
        assert_eq!(ratio(Some(1.0), Some(0.0)), None);
    }

    #[test]
    fn parses_the_rpc_lines_of_both_programs() {
        let text = "torch-rpc rpc_sync small  p50    312.5 us  p99    901.0 us\n\
            torch-rpc rpc_async small       8123 calls/s (5000 in flight)\n\
            torch-rpc echo  16 MiB     13.40 ms/round trip    2.504 GB/s\n\
            torch-rpc remote+to_here   p50    700.2 us\n\
            torch-rpc RemoteModule Linear(16,8) forward  p50    400.0 us\n";
        let m = parse_rpc(text);
        let keys: Vec<&str> = m.iter().map(|m| m.key.as_str()).collect();
        assert_eq!(
            keys,
            [
                "rpc_sync small p50",
                "rpc_sync small p99",
                "rpc_async 5000 in flight",
                "echo 16 MiB",
                "remote+to_here p50",
                "RemoteModule Linear fwd p50"
            ]
        );
        assert_eq!(m[5].value, 400.0);
        assert_eq!(m[0].value, 312.5);
        assert_eq!(m[1].value, 901.0);
        assert_eq!(m[2].value, 8123.0);
        assert_eq!(m[3].value, 2.504);
        assert_eq!(m[4].value, 700.2);
    }
}
