//! `cargo xtask test-resume`'s GPT cases: `gpt_distributed --layout L` with checkpoints, killed
//! at world 2 after its checkpoint at step 50 (`TENSORPLAY_GPT_KILL_AT=60:1`), then resumed by
//! a new job at world 1 and at world 4 from a copy of the checkpoint; the data-parallel and the
//! fully-sharded layouts. A case passes when the resumed job's losses (steps 50-99) are within
//! 1e-4 of an uninterrupted world-2 job's and its validation loss within 1e-3. One elastic case:
//! two `tensorplay-run --nnodes 1:2` nodes train the fully-sharded GPT; node 1 is killed with
//! its rank after step 60, and node 0 goes on alone, resuming at world 1 from the checkpoint.

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::Instant;

/// Steps of every run; checkpoints every [`EVERY`]; the kill after step [`KILL_AFTER`].
const STEPS: &str = "100";
const EVERY: &str = "50";
const KILL_AFTER: &str = "60";
/// The first step after the resume, and the bounds of the comparison.
const RESUMED_AT: usize = 50;
const LOSS_TOL: f64 = 1e-4;
const VAL_TOL: f64 = 1e-3;

/// A run's losses file (`--losses-out`).
struct Losses {
    losses: Vec<f64>,
    val_loss: f64,
}

fn read_losses(path: &Path) -> Result<Losses, String> {
    let text =
        std::fs::read_to_string(path).map_err(|e| format!("reading {}: {e}", path.display()))?;
    let v: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    let losses = v["losses"]
        .as_array()
        .map(|a| a.iter().filter_map(serde_json::Value::as_f64).collect())
        .ok_or_else(|| format!("{}: no losses", path.display()))?;
    let val_loss = v["val_loss"]
        .as_f64()
        .ok_or_else(|| format!("{}: no val_loss", path.display()))?;
    Ok(Losses { losses, val_loss })
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Runs `cmd` with the fault-injection variable `kill_at` (or none) and the flight recorders
/// sent to `fr`.
fn output(cmd: &mut Command, fr: &Path, kill_at: Option<&str>) -> Result<Output, String> {
    cmd.env_remove("TENSORPLAY_GPT_KILL_AT")
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .env("TENSORPLAY_FR_DIR", fr);
    if let Some(k) = kill_at {
        cmd.env("TENSORPLAY_GPT_KILL_AT", k);
    }
    cmd.output().map_err(|e| format!("could not start: {e}"))
}

/// `gpt --layout layout --world world --steps 100 ...extra`.
fn gpt(exe: &Path, layout: &str, world: usize, extra: &[&str]) -> Command {
    let mut c = Command::new(exe);
    c.args(["--layout", layout, "--world", &world.to_string()])
        .args(["--steps", STEPS, "--sample", "0"])
        .args(extra);
    c
}

/// Whether the resumed run `got` continues `want` (the uninterrupted run): `None` when it does,
/// else why not.
fn compare(got: &Losses, want: &Losses) -> Option<String> {
    if got.losses.len() != want.losses.len() {
        return Some(format!(
            "{} losses, the uninterrupted run has {}",
            got.losses.len(),
            want.losses.len()
        ));
    }
    let d = got.losses[RESUMED_AT..]
        .iter()
        .zip(&want.losses[RESUMED_AT..])
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    let dv = (got.val_loss - want.val_loss).abs();
    (d.is_nan() || d >= LOSS_TOL || dv.is_nan() || dv >= VAL_TOL).then(|| {
        format!(
            "loss difference {d:.2e} (bound {LOSS_TOL:e}), validation {dv:.2e} (bound {VAL_TOL:e})"
        )
    })
}

/// Copies the files of `from` into a new folder `to`.
fn copy_dir(from: &Path, to: &Path) -> Result<(), String> {
    std::fs::create_dir_all(to).map_err(|e| format!("{}: {e}", to.display()))?;
    let entries = std::fs::read_dir(from).map_err(|e| format!("{}: {e}", from.display()))?;
    for e in entries {
        let e = e.map_err(|e| format!("{}: {e}", from.display()))?;
        std::fs::copy(e.path(), to.join(e.file_name()))
            .map_err(|err| format!("copying {}: {err}", e.path().display()))?;
    }
    Ok(())
}

/// The four resize cases; returns the failures.
pub(crate) fn gpt_cases(
    launcher: &Path,
    gpt_exe: &Path,
    scratch: &Path,
    fr: &Path,
) -> Result<Vec<String>, String> {
    let mut failed = Vec::new();
    for layout in ["data-parallel", "fully-sharded"] {
        let t = Instant::now();
        let dir = scratch.join(format!("gpt-{layout}"));
        let plain_file = dir.join("uninterrupted.json");
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let plain_arg = plain_file.display().to_string();
        let o = output(
            &mut gpt(gpt_exe, layout, 2, &["--losses-out", &plain_arg]),
            fr,
            None,
        )?;
        if !o.status.success() {
            return Err(format!(
                "the uninterrupted gpt {layout} job failed ({}):\n{}",
                o.status,
                text(&o.stderr)
            ));
        }
        let want = read_losses(&plain_file)?;
        let ck = dir.join("checkpoint");
        let ck_arg = ck.display().to_string();
        let kill = format!("{KILL_AFTER}:1");
        let o = output(
            &mut gpt(
                gpt_exe,
                layout,
                2,
                &["--checkpoint-dir", &ck_arg, "--checkpoint-every", EVERY],
            ),
            fr,
            Some(&kill),
        )?;
        let err = text(&o.stderr);
        if o.status.success() || !err.contains("killing myself") {
            failed.push(format!(
                "gpt {layout}: the job to kill exited {} without the kill:\n{err}",
                o.status
            ));
            continue;
        }
        println!(
            "test-resume: gpt {layout} at 2 ranks: uninterrupted and killed after step \
             {KILL_AFTER} in {:.1}s",
            t.elapsed().as_secs_f64()
        );
        for world in [1, 4] {
            let t = Instant::now();
            let copy = dir.join(format!("resume-{world}"));
            copy_dir(&ck, &copy)?;
            let file = dir.join(format!("resumed-{world}.json"));
            let (copy_arg, file_arg) = (copy.display().to_string(), file.display().to_string());
            let o = output(
                &mut gpt(
                    gpt_exe,
                    layout,
                    world,
                    &[
                        "--checkpoint-dir",
                        &copy_arg,
                        "--checkpoint-every",
                        EVERY,
                        "--losses-out",
                        &file_arg,
                    ],
                ),
                fr,
                None,
            )?;
            let err = text(&o.stderr);
            let resumed =
                err.contains(&format!("resumed from the checkpoint at step {RESUMED_AT}"));
            let problem = if !o.status.success() {
                Some(format!("exit {}:\n{err}", o.status))
            } else if !resumed {
                Some(format!("it did not resume from step {RESUMED_AT}:\n{err}"))
            } else {
                compare(&read_losses(&file)?, &want)
            };
            match problem {
                None => println!(
                    "test-resume: gpt {layout} 2 -> {world} ranks: ok ({:.1}s)",
                    t.elapsed().as_secs_f64()
                ),
                Some(p) => {
                    println!("test-resume: gpt {layout} 2 -> {world} ranks: FAIL");
                    failed.push(format!("gpt {layout} 2 -> {world} ranks: {p}"));
                }
            }
        }
        // a run with another seed is refused on the same checkpoint, naming both settings
        let other = dir.join("other-seed");
        copy_dir(&ck, &other)?;
        let other_arg = other.display().to_string();
        let o = output(
            &mut gpt(
                gpt_exe,
                layout,
                2,
                &["--checkpoint-dir", &other_arg, "--seed", "1"],
            ),
            fr,
            None,
        )?;
        let err = text(&o.stderr);
        if o.status.success() || !err.contains("resume with the same --seed") {
            println!("test-resume: gpt {layout} with another --seed: FAIL");
            failed.push(format!(
                "gpt {layout}: another --seed was not refused (exit {}):\n{err}",
                o.status
            ));
        } else {
            println!("test-resume: gpt {layout} with another --seed: refused, ok");
        }
        // the uninterrupted run's losses serve the elastic case
        if layout == "fully-sharded"
            && let Some(p) = elastic(launcher, gpt_exe, scratch, fr, &want)?
        {
            failed.push(p);
        }
    }
    Ok(failed)
}

/// One elastic node of `--nnodes 1:2` running the fully-sharded GPT with checkpoints in `ck`.
fn node(launcher: &Path, port: u16, gpt_exe: &Path, ck: &Path, losses: &Path) -> Command {
    let mut c = Command::new(launcher);
    c.args([
        "--nnodes",
        "1:2",
        "--nproc-per-node",
        "1",
        "--max-restarts",
        "1",
    ])
    .args(["--rdzv-last-call", "2", "--master-addr", "127.0.0.1"])
    .args(["--master-port", &port.to_string()])
    .arg(gpt_exe)
    .args([
        "--layout",
        "fully-sharded",
        "--steps",
        STEPS,
        "--sample",
        "0",
    ])
    .arg("--checkpoint-dir")
    .arg(ck)
    .args(["--checkpoint-every", EVERY])
    .arg("--losses-out")
    .arg(losses)
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    c
}

/// The elastic case: `None` when it passed.
fn elastic(
    launcher: &Path,
    gpt_exe: &Path,
    scratch: &Path,
    fr: &Path,
    want: &Losses,
) -> Result<Option<String>, String> {
    let t = Instant::now();
    let dir = scratch.join("gpt-elastic");
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let (ck, file) = (dir.join("checkpoint"), dir.join("losses.json"));
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| format!("a free port: {e}"))?
        .port();
    let spawn = |kill: Option<&str>| {
        let mut c = node(launcher, port, gpt_exe, &ck, &file);
        c.env_remove("TENSORPLAY_GPT_KILL_AT")
            .env("TENSORPLAY_FR_DIR", fr);
        if let Some(k) = kill {
            c.env("TENSORPLAY_GPT_KILL_AT", k);
        }
        c.spawn().map_err(|e| format!("starting a node: {e}"))
    };
    // node 0 hosts the store: it starts first
    let n0 = spawn(None)?;
    std::thread::sleep(std::time::Duration::from_millis(500));
    let kill = format!("{KILL_AFTER}:1:node");
    let n1 = spawn(Some(&kill))?;
    let o0 = n0
        .wait_with_output()
        .map_err(|e| format!("waiting for node 0: {e}"))?;
    let o1 = n1
        .wait_with_output()
        .map_err(|e| format!("waiting for node 1: {e}"))?;
    let (out0, err0, err1) = (text(&o0.stdout), text(&o0.stderr), text(&o1.stderr));
    let problem = if !o0.status.success() {
        Some(format!("node 0 exited {}:\n{out0}{err0}", o0.status))
    } else if !err1.contains("killing my node's launcher") {
        Some(format!("node 1 was not killed:\n{err1}"))
    } else if !out0.contains("fully-sharded at 1 rank:")
        || !err0.contains("resumed from the checkpoint at step 50")
    {
        Some(format!(
            "node 0 did not resume alone at step 50:\n{out0}{err0}"
        ))
    } else {
        compare(&read_losses(&file)?, want)
    };
    Ok(match problem {
        None => {
            println!(
                "test-resume: gpt fully-sharded elastic (tensorplay-run --nnodes 1:2) 2 -> 1 \
                 ranks: ok ({:.1}s)",
                t.elapsed().as_secs_f64()
            );
            None
        }
        Some(p) => {
            println!("test-resume: gpt fully-sharded elastic 2 -> 1 ranks: FAIL");
            Some(format!("elastic: {p}"))
        }
    })
}
