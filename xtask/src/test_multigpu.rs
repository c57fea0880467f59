//! `test-multigpu`: the multi-rank test scenarios (real processes, one per rank) and the GPU
//! tests, then the differentiable collectives' suites. Nothing here lists tests by name: the
//! scenarios are discovered from the test binaries.
//!
//! **Discovery.** The workspace's test targets are built (`cargo test --workspace --no-run`,
//! or only the packages given with `-p`), and each test binary (unit and integration tests;
//! benches and examples excepted) is asked for its tests with `--list` and `--list --ignored`.
//! - **GPU tests** are the ignored tests whose ignore reason starts with `needs GPUs`, as in
//!   `#[ignore = "needs GPUs: cargo xtask test-multigpu"]`. `--list` does not print reasons,
//!   so each binary's ignored tests are run once without `--ignored`: libtest then executes
//!   none of them and reports each as `test NAME ... ignored, REASON`. A plain `cargo test`
//!   therefore shows them as ignored, never as passed. Here each runs with
//!   `--ignored --exact NAME` once for every GPU count n = 1..=GPUs (`nvidia-smi -L`), with
//!   `TENSORPLAY_TEST_NCCL_WORLD=n`, the world size a multi-GPU test uses (without it such a
//!   test uses every GPU it sees and fails when there is none).
//! - **Multi-rank scenarios** are the tests of the integration-test targets named
//!   `multiprocess` (the multi-process binaries: each test spawns its own ranks over
//!   127.0.0.1 with the "cpu" backend), each run alone (`--exact NAME`).
//!
//! Then the suites: `tensorplay-distributed-nn`'s tests and the conformance vectors (cpu; nccl
//! too where there are GPUs). Ends with `N passed, M failed, K not run (no GPU)`. Without a GPU
//! the GPU tests are listed as not run and the command fails once the rest has run (with
//! `--cpu-only` it succeeds then). `--list` prints what was discovered and stops.

use std::path::PathBuf;
use std::process::{Command, Stdio};

/// What a GPU test's ignore reason starts with.
pub(crate) const GPU_REASON: &str = "needs GPUs";

/// The environment variable that gives a GPU test its world size.
const WORLD_ENV: &str = "TENSORPLAY_TEST_NCCL_WORLD";

/// The name of the integration-test targets whose tests are the multi-rank scenarios.
const MULTIRANK_TARGET: &str = "multiprocess";

/// The conformance vector files run with each backend.
const VECTORS: &[&str] = &[
    "conformance/functional-w2.json",
    "conformance/functional-subgroup-w3.json",
];

/// The flags of `test-multigpu`.
#[derive(clap::Args)]
pub(crate) struct Args {
    /// Only discover in these packages (default: the whole workspace).
    #[arg(short = 'p', long = "package")]
    pub(crate) packages: Vec<String>,
    /// Print the discovered scenarios and GPU tests, run nothing.
    #[arg(long)]
    pub(crate) list: bool,
    /// Succeed without GPUs when everything else passed (the GPU tests still show as not run).
    #[arg(long)]
    pub(crate) cpu_only: bool,
}

/// A test binary cargo built.
#[derive(Debug, Clone)]
struct Binary {
    /// The package's folder (the tests run there, as under `cargo test`).
    dir: PathBuf,
    /// The target's name (`multiprocess`, or the crate's for unit tests).
    target: String,
    exe: PathBuf,
}

impl Binary {
    fn label(&self) -> String {
        let package = self
            .dir
            .file_name()
            .map_or_else(String::new, |n| n.to_string_lossy().into_owned());
        format!("{package}/{}", self.target)
    }

    fn command(&self) -> Command {
        let mut c = Command::new(&self.exe);
        c.current_dir(&self.dir)
            .env("CARGO_MANIFEST_DIR", &self.dir);
        c
    }
}

/// One test of a binary.
#[derive(Debug, Clone)]
struct Test {
    bin: Binary,
    name: String,
}

/// The string value after `key` in a JSON line (no escapes in the values read here).
fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    let i = line.find(key)? + key.len();
    let j = line[i..].find('"')?;
    Some(&line[i..i + j])
}

/// Reads the test binaries from `cargo test --no-run --message-format=json`'s output: the
/// artifacts built in the test profile, benches excepted.
fn binaries_in(json: &str) -> Vec<Binary> {
    json.lines()
        .filter(|l| l.contains("\"reason\":\"compiler-artifact\"") && l.contains("\"test\":true"))
        .filter_map(|l| {
            let kind = field(l, "\"kind\":[\"")?;
            if kind == "bench" {
                return None;
            }
            let manifest = PathBuf::from(field(l, "\"manifest_path\":\"")?);
            Some(Binary {
                dir: manifest.parent()?.to_path_buf(),
                target: field(l, "\"name\":\"")?.to_string(),
                exe: PathBuf::from(field(l, "\"executable\":\"")?),
            })
        })
        .collect()
}

/// Builds the test binaries (of the workspace, or of `packages`) and returns them.
fn build(packages: &[String]) -> Result<Vec<Binary>, String> {
    let mut args: Vec<String> = vec!["test".into(), "--no-run".into()];
    if packages.is_empty() {
        args.push("--workspace".into());
    }
    for p in packages {
        args.extend(["-p".into(), p.clone()]);
    }
    eprintln!("building the test binaries: cargo {}", args.join(" "));
    let out = Command::new("cargo")
        .args(&args)
        .args(["--message-format=json", "-q"])
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| format!("could not run cargo: {e}"))?;
    if !out.status.success() {
        // the JSON messages hid the compiler's errors: show them
        let _ = Command::new("cargo").args(&args).status();
        return Err(format!(
            "cargo {} failed (its errors are above)",
            args.join(" ")
        ));
    }
    Ok(binaries_in(&String::from_utf8_lossy(&out.stdout)))
}

/// The names in a `--list` output (`NAME: test` lines).
fn listed(text: &str) -> Vec<String> {
    text.lines()
        .filter_map(|l| l.strip_suffix(": test"))
        .map(str::to_string)
        .collect()
}

/// The ignore reasons in a run's output: `test NAME ... ignored, REASON` lines.
fn reasons(text: &str) -> Vec<(String, String)> {
    text.lines()
        .filter_map(|l| {
            let rest = l.strip_prefix("test ")?;
            let (name, status) = rest.split_once(" ... ")?;
            let reason = status.strip_prefix("ignored")?;
            Some((
                name.to_string(),
                reason.trim_start_matches(", ").to_string(),
            ))
        })
        .collect()
}

fn output_of(mut c: Command) -> Result<String, String> {
    let out = c
        .output()
        .map_err(|e| format!("could not run {c:?}: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "{c:?} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// What [`discover`] found: the multi-rank scenarios, and the GPU tests with their reasons.
#[derive(Default)]
struct Found {
    scenarios: Vec<Test>,
    gpu: Vec<(Test, String)>,
}

/// The multi-rank scenarios and the GPU tests of `bins`.
fn discover(bins: &[Binary]) -> Result<Found, String> {
    let Found {
        mut scenarios,
        mut gpu,
    } = Found::default();
    for bin in bins {
        let mut c = bin.command();
        c.args(["--list", "--ignored"]);
        let ignored = listed(&output_of(c)?);
        if !ignored.is_empty() {
            let mut c = bin.command();
            c.args(&ignored).arg("--exact");
            for (name, reason) in reasons(&output_of(c)?) {
                if reason.starts_with(GPU_REASON) {
                    let t = Test {
                        bin: bin.clone(),
                        name,
                    };
                    gpu.push((t, reason));
                }
            }
        }
        if bin.target == MULTIRANK_TARGET {
            let mut c = bin.command();
            c.arg("--list");
            scenarios.extend(listed(&output_of(c)?).into_iter().map(|name| Test {
                bin: bin.clone(),
                name,
            }));
        }
    }
    Ok(Found { scenarios, gpu })
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

/// Passed and failed so far.
#[derive(Default)]
struct Tally {
    passed: usize,
    failed: usize,
}

impl Tally {
    /// Counts one run and prints `ok` or `FAILED` with its output.
    fn record(&mut self, label: &str, out: std::io::Result<std::process::Output>, needs_one: bool) {
        match out {
            Ok(o) => {
                let text = String::from_utf8_lossy(&o.stdout);
                if o.status.success() && (!needs_one || text.contains("1 passed")) {
                    self.passed += 1;
                    println!("ok     {label}");
                } else {
                    self.failed += 1;
                    println!(
                        "FAILED {label}\n{text}\n{}",
                        String::from_utf8_lossy(&o.stderr)
                    );
                }
            }
            Err(e) => {
                self.failed += 1;
                println!("FAILED {label}: could not start: {e}");
            }
        }
    }
}

pub(crate) fn run(args: &Args) -> Result<(), String> {
    let bins = build(&args.packages)?;
    let Found {
        scenarios,
        gpu: gpu_tests,
    } = discover(&bins)?;
    let gpus = gpu_count();
    println!(
        "discovered {} multi-rank scenario(s) (tests of the `{MULTIRANK_TARGET}` targets) and \
         {} GPU test(s) (ignored with \"{GPU_REASON}...\") in {} test binaries:",
        scenarios.len(),
        gpu_tests.len(),
        bins.len()
    );
    for t in &scenarios {
        println!("  scenario {} {}", t.bin.label(), t.name);
    }
    for (t, reason) in &gpu_tests {
        println!("  gpu      {} {} ({reason})", t.bin.label(), t.name);
    }
    if args.list {
        return Ok(());
    }
    if gpus == 0 {
        println!(
            "no GPU found (nvidia-smi -L lists none): the {} GPU test(s) will not run, and do \
             not count as passed",
            gpu_tests.len()
        );
    } else {
        println!("{gpus} GPU(s): each GPU test runs with {WORLD_ENV}=1..={gpus}");
    }
    let mut tally = Tally::default();
    for t in &scenarios {
        let mut c = t.bin.command();
        c.args([t.name.as_str(), "--exact", "-q"]);
        tally.record(&t.name, c.output(), true);
    }
    for (t, _) in &gpu_tests {
        for n in 1..=gpus {
            let mut c = t.bin.command();
            c.args([t.name.as_str(), "--exact", "--ignored", "-q"])
                .env(WORLD_ENV, n.to_string());
            tally.record(&format!("{} {WORLD_ENV}={n}", t.name), c.output(), true);
        }
    }
    // the differentiable collectives: their multi-process test suites and the conformance
    // vectors (cpu backend; nccl too where there are GPUs)
    let mut suites: Vec<(String, Command)> = vec![];
    let mut tests = Command::new("cargo");
    tests.args(["test", "-q", "-p", "tensorplay-distributed-nn", "--tests"]);
    suites.push(("tensorplay-distributed-nn tests".into(), tests));
    let backends: &[&str] = if gpus > 0 { &["cpu", "nccl"] } else { &["cpu"] };
    for file in VECTORS {
        for backend in backends {
            let mut c = Command::new("cargo");
            c.args(["run", "-q", "-p", "tensorplay-conformance", "--"])
                .args(["--vectors", file, "--backend", backend]);
            suites.push((format!("conformance {file} --backend {backend}"), c));
        }
    }
    for (label, mut cmd) in suites {
        tally.record(
            &label,
            cmd.env("TENSORPLAY_SPAWN_VERBOSE", "0").output(),
            false,
        );
    }
    let not_run = if gpus == 0 { gpu_tests.len() } else { 0 };
    for (t, _) in gpu_tests.iter().filter(|_| not_run > 0) {
        println!("not run (no GPU) {} {}", t.bin.label(), t.name);
    }
    println!(
        "{} passed, {} failed, {not_run} not run (no GPU)",
        tally.passed, tally.failed
    );
    if tally.failed > 0 {
        return Err(format!("{} scenario(s) failed", tally.failed));
    }
    if not_run > 0 && !args.cpu_only {
        return Err(format!(
            "no GPU: {not_run} GPU test(s) not run (run this on a GPU machine; --cpu-only \
             accepts a run without them)"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_lists_reasons_and_artifacts() {
        let list =
            "world_size_2: test\ndouble::a_b: test\nbench_x: benchmark\n\n2 tests, 0 benchmarks\n";
        assert_eq!(listed(list), ["world_size_2", "double::a_b"]);
        let run = "running 2 tests\n\
            test nccl_world ... ignored, needs GPUs: cargo xtask test-multigpu\n\
            test slow_one ... ignored\n\
            test other ... ok\n\
            test result: ok. 0 passed; 0 failed; 2 ignored\n";
        assert_eq!(
            reasons(run),
            [
                (
                    "nccl_world".to_string(),
                    "needs GPUs: cargo xtask test-multigpu".to_string()
                ),
                ("slow_one".to_string(), String::new()),
            ]
        );
        let json = concat!(
            r#"{"reason":"compiler-artifact","package_id":"p","manifest_path":"/w/crates/c/Cargo.toml","target":{"kind":["test"],"crate_types":["bin"],"name":"multiprocess","src_path":"/w/crates/c/tests/multiprocess.rs"},"profile":{"test":true},"executable":"/t/debug/deps/multiprocess-1"}"#,
            "\n",
            r#"{"reason":"compiler-artifact","package_id":"p","manifest_path":"/w/crates/c/Cargo.toml","target":{"kind":["lib"],"crate_types":["lib"],"name":"c","src_path":"/w/crates/c/src/lib.rs"},"profile":{"test":false},"executable":null}"#,
            "\n",
            r#"{"reason":"compiler-artifact","package_id":"p","manifest_path":"/w/crates/c/Cargo.toml","target":{"kind":["bench"],"crate_types":["bin"],"name":"b","src_path":"/w/crates/c/benches/b.rs"},"profile":{"test":true},"executable":"/t/debug/deps/b-1"}"#,
            "\n"
        );
        let bins = binaries_in(json);
        assert_eq!(bins.len(), 1, "{bins:?}");
        assert_eq!(bins[0].target, "multiprocess");
        assert_eq!(bins[0].dir, PathBuf::from("/w/crates/c"));
        assert_eq!(bins[0].exe, PathBuf::from("/t/debug/deps/multiprocess-1"));
        assert_eq!(bins[0].label(), "c/multiprocess");
    }
}
