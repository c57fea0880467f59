//! `tensorplay-conformance`: runs files of conformance vectors against the differentiable
//! collectives of `tensorplay-distributed-nn` (`tensorplay::distributed::nn::functional`).
//!
//! The format (one JSON record per case and rank, the loss weights, the comparison rule, the
//! run order and the failure line) is described in `conformance/README.md` at the root of the
//! repository. [`run_file`] launches one world of real processes (through
//! [`spawn`](tensorplay_collectives::spawn())) for every world size in the file, rebuilds each
//! case on every rank, runs forward and backward, and compares outputs and gradients.
//!
//! `cargo xtask conformance --vectors FILE` is the command-line front end; this crate's tests
//! run the vector files of the repository.
//!
//! Because [`run_file`] uses `spawn`, which re-executes the current program, call it from
//! `main` (or a test) before anything that must not run once per rank; in a spawned child it
//! runs the child's share of the work and exits.

use std::collections::BTreeMap;
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;
use tensorplay_collectives::{self as dist, InitOptions, ProcessGroup, ReduceOp, SpawnOptions};
use tensorplay_core::{Device, Tensor};
use tensorplay_distributed_nn::functional as df;

/// Environment variable telling a spawned child which world (size) it belongs to.
const WORLD_ENV: &str = "TENSORPLAY_CONFORMANCE_WORLD";
/// Environment variable naming the directory where children write their results.
const OUT_ENV: &str = "TENSORPLAY_CONFORMANCE_OUT";

/// Relative tolerance of the comparison rule: `|a - e| <= RTOL * max(1, |e|)`.
pub const RTOL: f64 = 1e-9;

/// Errors of the runner itself (not of the vectors under test, which are reported as failing
/// records).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The vectors file could not be read.
    #[error("cannot read {path}: {source}", path = .0.display(), source = .1)]
    Io(PathBuf, std::io::Error),
    /// The vectors file is not a JSON array of records.
    #[error("{path} is not a conformance vectors file (a JSON array of records): {source}", path = .0.display(), source = .1)]
    Parse(PathBuf, serde_json::Error),
}

/// A tensor of a record: shape and row-major float64 data.
#[derive(Debug, Clone, Deserialize)]
pub struct TensorData {
    /// Shape.
    pub shape: Vec<usize>,
    /// Row-major values.
    pub data: Vec<f64>,
}

/// One record: one case on one rank.
#[derive(Debug, Clone, Deserialize)]
pub struct Record {
    /// The case's label.
    pub case: String,
    /// The function under test.
    #[serde(rename = "fn")]
    pub func: String,
    /// World size.
    pub world: usize,
    /// Global rank of this record.
    pub rank: usize,
    /// `src`, `dst`, `op`, `input_split_sizes`, `output_split_sizes` (any JSON values; checked
    /// when the case is validated).
    #[serde(default)]
    pub params: BTreeMap<String, serde_json::Value>,
    /// The group's global ranks (the whole world when absent).
    #[serde(default)]
    pub group: Option<Vec<usize>>,
    /// The differentiable inputs.
    pub inputs: Vec<TensorData>,
    /// Expected forward outputs.
    pub outputs: Vec<TensorData>,
    /// Expected input gradients.
    pub grads: Vec<TensorData>,
    /// Whether the outputs are compared.
    #[serde(default = "yes")]
    pub compare_outputs: bool,
}

fn yes() -> bool {
    true
}

/// Reads a vectors file.
///
/// # Errors
/// [`Error::Io`] or [`Error::Parse`].
pub fn load(path: &Path) -> Result<Vec<Record>, Error> {
    let text = fs::read_to_string(path).map_err(|e| Error::Io(path.into(), e))?;
    serde_json::from_str(&text).map_err(|e| Error::Parse(path.into(), e))
}

/// Options of [`run_file`].
#[derive(Debug, Clone)]
pub struct RunOptions {
    /// `"cpu"` (default) or `"nccl"` (tensors on `cuda:<local rank>`).
    pub backend: String,
    /// Timeout of every collective (default 30 s): a rank that errors leaves the others
    /// waiting this long at most.
    pub timeout: Duration,
    /// Overall limit for one world's processes (default 600 s).
    pub world_timeout: Duration,
}

impl Default for RunOptions {
    fn default() -> Self {
        RunOptions {
            backend: "cpu".into(),
            timeout: Duration::from_secs(30),
            world_timeout: Duration::from_secs(600),
        }
    }
}

/// The outcome of a run.
#[derive(Debug, Clone, Default)]
pub struct Summary {
    /// Records that passed.
    pub passed: usize,
    /// Records that failed.
    pub failed: usize,
    /// One `FAIL <case> rank <r> ...` line per failing record, in the file's case order.
    pub lines: Vec<String>,
}

impl std::fmt::Display for Summary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for l in &self.lines {
            writeln!(f, "{l}")?;
        }
        write!(f, "{} passed, {} failed", self.passed, self.failed)
    }
}

/// A case: its label, its records (file order) and whether it can run.
struct Case {
    label: String,
    world: usize,
    members: Vec<usize>,
    records: Vec<Record>,
    invalid: Option<String>,
}

const FNS: &[&str] = &[
    "broadcast",
    "reduce",
    "all_reduce",
    "gather",
    "scatter",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "all_to_all_single",
];

fn parse_op(v: Option<&serde_json::Value>) -> Result<ReduceOp, String> {
    match v {
        None => Ok(ReduceOp::Sum),
        Some(serde_json::Value::String(s)) => match s.as_str() {
            "sum" => Ok(ReduceOp::Sum),
            "avg" => Ok(ReduceOp::Avg),
            "max" => Ok(ReduceOp::Max),
            "min" => Ok(ReduceOp::Min),
            "product" => Ok(ReduceOp::Product),
            other => Err(format!("unknown op {other:?}")),
        },
        Some(other) => Err(format!("op must be a string, got {other}")),
    }
}

fn param_rank(r: &Record, key: &str) -> Result<Option<usize>, String> {
    match r.params.get(key) {
        None => Ok(None),
        Some(v) => v
            .as_u64()
            .map(|u| Some(u as usize))
            .ok_or_else(|| format!("{key} must be a non-negative integer, got {v}")),
    }
}

fn param_splits(r: &Record, key: &str) -> Result<Option<Vec<usize>>, String> {
    match r.params.get(key) {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(serde_json::Value::Array(a)) => a
            .iter()
            .map(|v| {
                v.as_u64()
                    .map(|u| u as usize)
                    .ok_or_else(|| format!("{key} must hold non-negative integers, got {v}"))
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Some),
        Some(v) => Err(format!("{key} must be a list, got {v}")),
    }
}

/// Checks one record's fields; `Err` names what is unknown or malformed.
fn validate(r: &Record) -> Result<(), String> {
    if !FNS.contains(&r.func.as_str()) {
        return Err(format!("unknown fn {:?}", r.func));
    }
    let allowed: &[&str] = match r.func.as_str() {
        "broadcast" | "scatter" => &["src"],
        "gather" => &["dst"],
        "reduce" => &["dst", "op"],
        "all_reduce" | "reduce_scatter" => &["op"],
        "all_to_all_single" => &["input_split_sizes", "output_split_sizes"],
        _ => &[],
    };
    for k in r.params.keys() {
        if !allowed.contains(&k.as_str()) {
            return Err(format!("unknown parameter {k:?} for {}", r.func));
        }
    }
    parse_op(r.params.get("op"))?;
    for key in ["src", "dst"] {
        if allowed.contains(&key) {
            let v = param_rank(r, key)?.ok_or_else(|| format!("missing parameter {key}"))?;
            if v >= r.world {
                return Err(format!("{key} {v} is not a rank of a world of {}", r.world));
            }
        }
    }
    param_splits(r, "input_split_sizes")?;
    param_splits(r, "output_split_sizes")?;
    if r.world == 0 || r.rank >= r.world {
        return Err(format!("rank {} in a world of {}", r.rank, r.world));
    }
    for (what, list) in [
        ("inputs", &r.inputs),
        ("outputs", &r.outputs),
        ("grads", &r.grads),
    ] {
        for (i, t) in list.iter().enumerate() {
            let n: usize = t.shape.iter().product();
            if n != t.data.len() {
                return Err(format!(
                    "{what}[{i}] has shape {:?} but {} values",
                    t.shape,
                    t.data.len()
                ));
            }
        }
    }
    if r.inputs.is_empty() {
        return Err("no inputs".into());
    }
    if r.grads.len() != r.inputs.len() {
        return Err(format!(
            "{} grads for {} inputs",
            r.grads.len(),
            r.inputs.len()
        ));
    }
    Ok(())
}

/// Groups records into cases in the order each label first appears, and validates them.
fn cases(records: &[Record]) -> Vec<Case> {
    let mut out: Vec<Case> = vec![];
    for r in records {
        match out.iter_mut().find(|c| c.label == r.case) {
            Some(c) => c.records.push(r.clone()),
            None => out.push(Case {
                label: r.case.clone(),
                world: r.world,
                members: vec![],
                records: vec![r.clone()],
                invalid: None,
            }),
        }
    }
    for c in &mut out {
        let first = &c.records[0];
        c.members = first
            .group
            .clone()
            .unwrap_or_else(|| (0..first.world).collect());
        let mut problem = c.records.iter().find_map(|r| validate(r).err());
        if problem.is_none() {
            problem = check_case(c);
        }
        c.invalid = problem;
    }
    out
}

/// Cross-record checks: one world, one group, one fn, one record per member.
fn check_case(c: &Case) -> Option<String> {
    let first = &c.records[0];
    let mut members = c.members.clone();
    members.sort_unstable();
    if members.is_empty()
        || members.windows(2).any(|w| w[0] == w[1])
        || members.iter().any(|&m| m >= first.world)
    {
        return Some(format!(
            "group {:?} is not a set of ranks of a world of {}",
            c.members, first.world
        ));
    }
    for r in &c.records {
        if r.world != first.world || r.group != first.group || r.func != first.func {
            return Some("records disagree on world, group or fn".into());
        }
        if !c.members.contains(&r.rank) {
            return Some(format!(
                "rank {} is not in the group {:?}",
                r.rank, c.members
            ));
        }
    }
    for &m in &c.members {
        match c.records.iter().filter(|r| r.rank == m).count() {
            1 => {}
            0 => return Some(format!("no record for group member rank {m}")),
            _ => return Some(format!("several records for rank {m}")),
        }
    }
    None
}

/// What a rank reports for one record.
#[derive(Debug, Clone)]
enum Outcome {
    /// Passed.
    Pass,
    /// The first differing value.
    Differs(String),
    /// The case raised an error on this rank.
    Error(String),
}

/// Runs every case of `path` and returns the summary.
///
/// Worlds run one after another, in the order their sizes first appear; within a world,
/// cases run in the order their labels first appear, all ranks together. Cases with an
/// unknown `fn`, `op` or parameter, or inconsistent records, fail without running. A rank
/// that errors, crashes or times out fails every record of its case.
///
/// In a child spawned by this function, it runs that child's share and exits the process.
///
/// # Errors
/// The file cannot be read or parsed, or the results directory cannot be created.
pub fn run_file(path: &Path, opts: &RunOptions) -> Result<Summary, Error> {
    let records = load(path)?;
    let cases = cases(&records);
    let mut worlds: Vec<usize> = vec![];
    for c in &cases {
        if c.invalid.is_none() && !worlds.contains(&c.world) {
            worlds.push(c.world);
        }
    }
    if let Ok(w) = std::env::var(WORLD_ENV) {
        // a spawned child: run its world only (spawn runs the worker and exits)
        if let Ok(w) = w.parse::<usize>() {
            let _ = run_world(&cases, w, opts, Path::new(""));
        }
    }
    if std::env::var_os("TENSORPLAY_RUN").is_some_and(|v| v == "1") {
        // a rank of a launcher's job: its world's `spawn` joins the job, judges this rank's
        // records and exits; no results folder (it would be left behind)
        for &w in &worlds {
            let _ = run_world(&cases, w, opts, Path::new(""));
        }
    }
    let dir = std::env::temp_dir().join(format!(
        "tensorplay-conformance-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos())
    ));
    fs::create_dir_all(&dir).map_err(|e| Error::Io(dir.clone(), e))?;
    let mut outcomes: BTreeMap<(String, usize), Outcome> = BTreeMap::new();
    let mut world_errors: BTreeMap<usize, String> = BTreeMap::new();
    for &w in &worlds {
        if let Err(e) = run_world(&cases, w, opts, &dir) {
            world_errors.insert(w, first_line(&e));
        }
        for rank in 0..w {
            let file = dir.join(format!("world{w}-rank{rank}.jsonl"));
            let Ok(text) = fs::read_to_string(&file) else {
                continue;
            };
            for line in text.lines() {
                if let Ok((case, r, outcome)) = parse_result(line) {
                    outcomes.insert((case, r), outcome);
                }
            }
        }
    }
    let _ = fs::remove_dir_all(&dir);
    Ok(summarize(&cases, &outcomes, &world_errors))
}

fn first_line(e: &impl std::fmt::Display) -> String {
    e.to_string().lines().next().unwrap_or("").to_string()
}

/// Combines the ranks' outcomes into the summary: one line per failing record.
fn summarize(
    cases: &[Case],
    outcomes: &BTreeMap<(String, usize), Outcome>,
    world_errors: &BTreeMap<usize, String>,
) -> Summary {
    let mut s = Summary::default();
    for c in cases {
        let mut fail = |line: String| {
            s.failed += 1;
            s.lines.push(line);
        };
        if let Some(why) = &c.invalid {
            for r in &c.records {
                fail(format!(
                    "FAIL {} rank {}: invalid case: {why}",
                    c.label, r.rank
                ));
            }
            continue;
        }
        // an error (or a missing result) on any rank fails the whole case
        let failing_rank =
            c.records
                .iter()
                .find_map(|r| match outcomes.get(&(c.label.clone(), r.rank)) {
                    Some(Outcome::Error(e)) => Some((r.rank, e.clone())),
                    None => Some((
                        r.rank,
                        format!(
                            "no result: the rank crashed or the run was stopped ({})",
                            world_errors
                                .get(&c.world)
                                .map_or("no error reported", String::as_str)
                        ),
                    )),
                    _ => None,
                });
        for r in &c.records {
            let mine = outcomes.get(&(c.label.clone(), r.rank));
            match (mine, &failing_rank) {
                (Some(Outcome::Error(e)), _) => {
                    fail(format!("FAIL {} rank {}: error: {e}", c.label, r.rank))
                }
                (_, Some((k, e))) if *k != r.rank || mine.is_none() => fail(format!(
                    "FAIL {} rank {}: rank {k} failed: {e}",
                    c.label, r.rank
                )),
                (Some(Outcome::Differs(d)), _) => {
                    fail(format!("FAIL {} rank {} {d}", c.label, r.rank))
                }
                (Some(Outcome::Pass), None) => s.passed += 1,
                (_, _) => fail(format!("FAIL {} rank {}: no result", c.label, r.rank)),
            }
        }
    }
    s
}

/// Spawns (in the parent) or runs (in a child) the processes of world `w`.
fn run_world(cases: &[Case], w: usize, opts: &RunOptions, dir: &Path) -> dist::Result<()> {
    let mine: Vec<&Case> = cases
        .iter()
        .filter(|c| c.world == w && c.invalid.is_none())
        .collect();
    let spawn_opts = SpawnOptions {
        timeout: Some(opts.world_timeout),
        env: vec![
            (WORLD_ENV.into(), w.to_string()),
            (OUT_ENV.into(), dir.display().to_string()),
            // the children route themselves to their world's call (the first `spawn` they
            // reach, in `run_file`), so that call is theirs whichever world this is
            (dist::spawn::SPAWN_CALLS_ENV.into(), "0".into()),
        ],
        ..SpawnOptions::new(w)
    };
    dist::spawn_with(spawn_opts, |rank| Ok(worker(rank, w, &mine, opts)?))
}

/// One rank of world `w`: every case of the world, in order.
///
/// Started by [`run_file`]'s `spawn`, it writes its outcomes to the results folder for the
/// parent to summarize. Under `tensorplay-run` (`spawn` joined the launcher's job, possibly
/// across hosts, and there is no parent and no shared folder) it judges its own records
/// instead: it prints `conformance: rank R: N passed, M failed` and every failing record, and
/// fails (so its launcher exits non-zero) when any record failed.
fn worker(rank: usize, w: usize, cases: &[&Case], opts: &RunOptions) -> dist::Result<()> {
    let mut out: Box<dyn Write> = match std::env::var_os(OUT_ENV) {
        Some(dir) => Box::new(fs::File::create(
            PathBuf::from(dir).join(format!("world{w}-rank{rank}.jsonl")),
        )?),
        None => Box::new(std::io::sink()),
    };
    let joined = std::env::var_os(OUT_ENV).is_none();
    let (mut passed, mut failures) = (0usize, Vec::new());
    tensorplay_nccl::register();
    dist::init_process_group(
        &opts.backend,
        InitOptions {
            // generous for rendezvous and new_group, which may wait for a rank stuck in a
            // failed case's collective
            timeout: opts.timeout * 3,
            ..Default::default()
        },
    )?;
    let device = if opts.backend == "nccl" {
        Device::Cuda(rank % tensorplay_core::cuda::device_count().max(1))
    } else {
        Device::Cpu
    };
    for c in cases {
        // every rank of the world creates the case's group, members or not (as new_group
        // requires), so a failure in one case cannot leave the next out of step
        let group = dist::new_group(&c.members, None, Some(opts.timeout));
        let Some(rec) = c.records.iter().find(|r| r.rank == rank) else {
            continue;
        };
        let outcome = match group
            .map_err(|e| e.to_string())
            .and_then(|g| run_case(rec, &g, device).map_err(|e| e.to_string()))
        {
            Ok(None) => Outcome::Pass,
            Ok(Some(d)) => Outcome::Differs(d),
            Err(e) => Outcome::Error(e.replace('\n', " ")),
        };
        writeln!(out, "{}", result_line(&c.label, rank, &outcome))?;
        out.flush()?;
        match &outcome {
            Outcome::Pass => passed += 1,
            Outcome::Differs(d) => failures.push(format!("FAIL {} rank {rank} {d}", c.label)),
            Outcome::Error(e) => failures.push(format!("FAIL {} rank {rank}: error: {e}", c.label)),
        }
    }
    // rank 0 hosts the store: nobody leaves while others may still need it
    dist::barrier(None)?;
    dist::destroy_process_group()?;
    if joined {
        println!(
            "conformance: rank {rank}: {passed} passed, {} failed",
            failures.len()
        );
        for f in &failures {
            println!("{f}");
        }
        // a rank outside every case's group has no records (rank 0 of a file about the
        // subgroup {1, 2}); one with records must have judged them all
        let records = cases
            .iter()
            .filter(|c| c.records.iter().any(|r| r.rank == rank))
            .count();
        if !failures.is_empty() || passed != records {
            return Err(dist::Error::Io(format!(
                "conformance: rank {rank}: {} of {records} records failed",
                records - passed
            )));
        }
    }
    Ok(())
}

fn result_line(case: &str, rank: usize, o: &Outcome) -> String {
    let (kind, text) = match o {
        Outcome::Pass => ("pass", String::new()),
        Outcome::Differs(d) => ("differs", d.clone()),
        Outcome::Error(e) => ("error", e.clone()),
    };
    serde_json::json!({"case": case, "rank": rank, "kind": kind, "text": text}).to_string()
}

fn parse_result(line: &str) -> Result<(String, usize, Outcome), ()> {
    let v: serde_json::Value = serde_json::from_str(line).map_err(|_| ())?;
    let case = v["case"].as_str().ok_or(())?.to_string();
    let rank = v["rank"].as_u64().ok_or(())? as usize;
    let text = v["text"].as_str().unwrap_or("").to_string();
    let o = match v["kind"].as_str() {
        Some("pass") => Outcome::Pass,
        Some("differs") => Outcome::Differs(text),
        _ => Outcome::Error(text),
    };
    Ok((case, rank, o))
}

/// The loss weight of output `k` on rank `rank`:
/// `(arange(numel) % 7 + 1) * (rank + 1) + 0.25 * k`, float64, of `shape`.
pub fn weight(rank: usize, shape: &[usize], k: usize) -> tensorplay_core::Result<Tensor> {
    let n: usize = shape.iter().product();
    let v: Vec<f64> = (0..n)
        .map(|i| ((i % 7) + 1) as f64 * (rank + 1) as f64 + 0.25 * k as f64)
        .collect();
    Tensor::from_vec(v, shape)
}

/// Runs one record's case on this rank; `Ok(None)` when outputs and gradients match,
/// `Ok(Some(line))` with the first difference, `Err` when the case failed.
fn run_case(
    rec: &Record,
    g: &ProcessGroup,
    device: Device,
) -> tensorplay_core::Result<Option<String>> {
    let inputs = rec
        .inputs
        .iter()
        .map(|t| {
            Ok(Tensor::from_vec(t.data.clone(), &t.shape)?
                .to_device(device)?
                .requires_grad_(true))
        })
        .collect::<tensorplay_core::Result<Vec<_>>>()?;
    let bad = |e: String| tensorplay_core::Error::external(dist::Error::Io(e));
    let op = parse_op(rec.params.get("op")).map_err(bad)?;
    let src = param_rank(rec, "src").map_err(bad)?.unwrap_or(0);
    let dst = param_rank(rec, "dst").map_err(bad)?.unwrap_or(0);
    let ins = param_splits(rec, "input_split_sizes").map_err(bad)?;
    let outs = param_splits(rec, "output_split_sizes").map_err(bad)?;
    let x = &inputs[0];
    let gp = Some(g);
    let outputs: Vec<Tensor> = match rec.func.as_str() {
        "broadcast" => vec![df::broadcast(x, src, gp)?],
        "reduce" => vec![df::reduce(x, dst, op, gp)?],
        "all_reduce" => vec![df::all_reduce(x, op, gp)?],
        "gather" => df::gather(x, dst, gp)?,
        "scatter" => vec![df::scatter(Some(&inputs), src, gp)?],
        "all_gather" => df::all_gather(x, gp)?,
        "reduce_scatter" => vec![df::reduce_scatter(&inputs, op, gp)?],
        "all_to_all" => df::all_to_all(&inputs, gp)?,
        "all_to_all_single" => vec![df::all_to_all_single(
            x,
            outs.as_deref(),
            ins.as_deref(),
            gp,
        )?],
        other => return Err(bad(format!("unknown fn {other:?}"))),
    };
    // the loss on the host (the core computes on the CPU)
    let mut loss: Option<Tensor> = None;
    for (k, y) in outputs.iter().enumerate() {
        let term = y
            .to_device(Device::Cpu)?
            .mul(&weight(rec.rank, y.shape(), k)?)?
            .sum()?;
        loss = Some(match loss {
            Some(l) => l.add(&term)?,
            None => term,
        });
    }
    if let Some(l) = loss.as_ref().filter(|l| l.requires_grad()) {
        l.backward()?;
    }
    if rec.compare_outputs
        && let Some(d) = compare("outputs", &rec.outputs, &outputs)?
    {
        return Ok(Some(d));
    }
    let grads: Vec<Option<Tensor>> = inputs.iter().map(Tensor::grad).collect();
    for (i, (want, got)) in rec.grads.iter().zip(&grads).enumerate() {
        let Some(got) = got else {
            return Ok(Some(format!("grads[{i}]: expected a gradient, got none")));
        };
        if let Some(d) = compare_one(&format!("grads[{i}]"), want, got)? {
            return Ok(Some(d));
        }
    }
    Ok(None)
}

/// The first difference between expected and actual tensors, as `what[i][j]: expected e got a`.
fn compare(
    what: &str,
    want: &[TensorData],
    got: &[Tensor],
) -> tensorplay_core::Result<Option<String>> {
    if want.len() != got.len() {
        return Ok(Some(format!(
            "{what}: expected {} tensors got {}",
            want.len(),
            got.len()
        )));
    }
    for (i, (w, g)) in want.iter().zip(got).enumerate() {
        if let Some(d) = compare_one(&format!("{what}[{i}]"), w, g)? {
            return Ok(Some(d));
        }
    }
    Ok(None)
}

fn compare_one(
    what: &str,
    want: &TensorData,
    got: &Tensor,
) -> tensorplay_core::Result<Option<String>> {
    if got.shape() != want.shape.as_slice() {
        return Ok(Some(format!(
            "{what}: expected shape {:?} got {:?}",
            want.shape,
            got.shape()
        )));
    }
    let vals = got.to_device(Device::Cpu)?.to_vec_f64()?;
    for (j, (&e, &a)) in want.data.iter().zip(&vals).enumerate() {
        let close = (a - e).abs() <= RTOL * e.abs().max(1.0);
        if !close {
            return Ok(Some(format!("{what}[{j}]: expected {e} got {a}")));
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(json: &str) -> Record {
        serde_json::from_str(json).expect("record")
    }

    #[test]
    fn weights_follow_the_format() {
        let w = weight(1, &[2, 4], 2).unwrap().to_vec::<f64>().unwrap();
        assert_eq!(w, vec![2.5, 4.5, 6.5, 8.5, 10.5, 12.5, 14.5, 2.5]);
    }

    #[test]
    fn unknown_fn_op_and_fields_invalidate_the_case() {
        let base = r#"{"case":"c","fn":"FN","world":1,"rank":0,"params":PARAMS,
            "inputs":[{"shape":[1],"data":[1.0]}],"outputs":[{"shape":[1],"data":[1.0]}],
            "grads":[{"shape":[1],"data":[1.0]}]}"#;
        let mk = |f: &str, p: &str| rec(&base.replace("FN", f).replace("PARAMS", p));
        assert!(validate(&mk("all_reduce", r#"{"op":"sum"}"#)).is_ok());
        assert!(
            validate(&mk("all_reduce_v", "{}"))
                .unwrap_err()
                .contains("unknown fn")
        );
        assert!(
            validate(&mk("all_reduce", r#"{"op":"premul_sum"}"#))
                .unwrap_err()
                .contains("unknown op")
        );
        assert!(
            validate(&mk("all_reduce", r#"{"op":"sum","colour":1}"#))
                .unwrap_err()
                .contains("unknown parameter")
        );
        assert!(
            validate(&mk("broadcast", "{}"))
                .unwrap_err()
                .contains("missing parameter src")
        );
        assert!(
            validate(&mk("broadcast", r#"{"src":3}"#))
                .unwrap_err()
                .contains("not a rank")
        );
        let cs = cases(&[mk("nope", "{}")]);
        let s = summarize(&cs, &BTreeMap::new(), &BTreeMap::new());
        assert_eq!((s.passed, s.failed), (0, 1));
        assert!(
            s.lines[0].starts_with("FAIL c rank 0: invalid case: unknown fn"),
            "{}",
            s.lines[0]
        );
    }

    #[test]
    fn one_rank_error_fails_every_record_of_the_case() {
        let r = |rank: usize| {
            rec(&format!(
                r#"{{"case":"c","fn":"all_reduce","world":2,"rank":{rank},"params":{{}},
                "inputs":[{{"shape":[1],"data":[1.0]}}],"outputs":[{{"shape":[1],"data":[2.0]}}],
                "grads":[{{"shape":[1],"data":[3.0]}}]}}"#
            ))
        };
        let cs = cases(&[r(0), r(1)]);
        let mut o = BTreeMap::new();
        o.insert(("c".to_string(), 0), Outcome::Pass);
        o.insert(("c".to_string(), 1), Outcome::Error("boom".into()));
        let s = summarize(&cs, &o, &BTreeMap::new());
        assert_eq!((s.passed, s.failed), (0, 2));
        assert_eq!(s.lines[0], "FAIL c rank 0: rank 1 failed: boom");
        assert_eq!(s.lines[1], "FAIL c rank 1: error: boom");
        // a missing result (crash) fails the case too
        let mut o = BTreeMap::new();
        o.insert(("c".to_string(), 0), Outcome::Pass);
        let s = summarize(&cs, &o, &BTreeMap::new());
        assert_eq!((s.passed, s.failed), (0, 2));
    }

    #[test]
    fn comparison_rule_is_relative_above_one() {
        let want = TensorData {
            shape: vec![3],
            data: vec![0.5, 1e6, -2.0],
        };
        let ok = Tensor::from_vec(vec![0.5 + 5e-10, 1e6 + 5e-4, -2.0], &[3]).unwrap();
        assert_eq!(compare_one("outputs[0]", &want, &ok).unwrap(), None);
        let bad = Tensor::from_vec(vec![0.5, 1e6 + 2e-3, -2.0], &[3]).unwrap();
        assert_eq!(
            compare_one("outputs[0]", &want, &bad).unwrap().unwrap(),
            "outputs[0][1]: expected 1000000 got 1000000.002"
        );
        let nan = Tensor::from_vec(vec![f64::NAN, 1e6, -2.0], &[3]).unwrap();
        assert!(compare_one("x", &want, &nan).unwrap().is_some());
        let shape = Tensor::from_vec(vec![0.5, 1e6, -2.0], &[3, 1]).unwrap();
        assert!(
            compare_one("x", &want, &shape)
                .unwrap()
                .unwrap()
                .contains("shape")
        );
    }
}
