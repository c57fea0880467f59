//! `cargo xtask test-resume`: the main job, killed and restarted, prints what it prints when
//! nothing happens. `tensorplay-run --max-restarts 2` runs `wine_distributed` with checkpoints
//! while one rank SIGKILLs itself once (`TENSORPLAY_WINE_KILL_AT`) in each of the three runs in
//! turn (sharded, RPC owners, replicated checkpoints); each job must exit 0 with result lines
//! byte-identical to an uninterrupted job's. With `--max-restarts 0` the same kill stops the
//! job, naming the killed rank. Then the GPT's checkpoints resume at other world sizes
//! (`resume_gpt.rs`).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Instant;

use crate::multihost::{executables, find};

/// A scratch folder, removed when dropped.
struct Scratch(PathBuf);
impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The `<run>: test accuracy A, max loss difference D` lines of a launcher's output, without
/// the `[rank 0] ` prefix.
fn result_lines(stdout: &str) -> Vec<String> {
    stdout
        .lines()
        .filter(|l| l.contains(": test accuracy "))
        .map(|l| l.trim_start_matches("[rank 0] ").to_string())
        .collect()
}

/// Runs the launcher; the flight recorders of failed rounds go to `fr_dir` (the scratch
/// folder, removed at the end), not to the temp dir.
fn launch(
    launcher: &Path,
    fr_dir: &Path,
    args: &[&str],
    kill_at: Option<&str>,
) -> Result<Output, String> {
    let mut c = Command::new(launcher);
    c.args(args)
        .env_remove("TENSORPLAY_WINE_KILL_AT")
        .env("TENSORPLAY_FR_DIR", fr_dir);
    if let Some(k) = kill_at {
        c.env("TENSORPLAY_WINE_KILL_AT", k);
    }
    c.output()
        .map_err(|e| format!("could not start {}: {e}", launcher.display()))
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

pub(crate) fn test_resume() -> Result<(), String> {
    let bins = executables(
        &[
            "build",
            "--workspace",
            "--bin",
            "tensorplay-run",
            "--example",
            "wine_distributed",
            "--example",
            "gpt_distributed",
        ],
        &["tensorplay-run", "wine_distributed", "gpt_distributed"],
    )?;
    let (launcher, wine, gpt) = (
        find(&bins, "tensorplay-run")?,
        find(&bins, "wine_distributed")?,
        find(&bins, "gpt_distributed")?,
    );
    let wine = wine.display().to_string();
    let scratch = Scratch(std::env::temp_dir().join(format!("tp-resume-{}", std::process::id())));
    let fr = scratch.0.join("flight-recorder");
    std::fs::create_dir_all(&fr).map_err(|e| format!("scratch folder: {e}"))?;

    let t0 = Instant::now();
    let plain = launch(&launcher, &fr, &["--nproc-per-node", "2", &wine], None)?;
    let expected = result_lines(&text(&plain.stdout));
    if !plain.status.success() || expected.len() != 3 {
        return Err(format!(
            "the uninterrupted job failed ({}):\n{}{}",
            plain.status,
            text(&plain.stdout),
            text(&plain.stderr)
        ));
    }
    println!(
        "test-resume: uninterrupted job in {:.1}s:",
        t0.elapsed().as_secs_f64()
    );
    for l in &expected {
        println!("    {l}");
    }
    let mut failed = Vec::new();
    for kill_at in [
        "tensor-parallel:1234:1",
        "parameter-server:2050:0",
        "data-parallel:3333:0",
    ] {
        let t = Instant::now();
        let dir = scratch.0.join(kill_at.replace(':', "-"));
        let dir = dir.display().to_string();
        let o = launch(
            &launcher,
            &fr,
            &[
                "--nproc-per-node",
                "2",
                "--max-restarts",
                "2",
                &wine,
                "--checkpoint-dir",
                &dir,
                "--checkpoint-every",
                "100",
            ],
            Some(kill_at),
        )?;
        let (out, err) = (text(&o.stdout), text(&o.stderr));
        let got = result_lines(&out);
        let killed = err.contains("killing myself");
        let ok = o.status.success() && killed && got == expected;
        println!(
            "test-resume: {} killed at {kill_at}, restarted: exit {}, {} in {:.1}s",
            if ok { "ok  " } else { "FAIL" },
            o.status.code().unwrap_or(-1),
            if got == expected {
                "the same result lines"
            } else {
                "OTHER result lines"
            },
            t.elapsed().as_secs_f64()
        );
        if !ok {
            failed.push(format!(
                "{kill_at}: exit {}, kill seen: {killed}, lines {got:?}\nstderr:\n{err}",
                o.status
            ));
        }
    }
    // no restarts: the kill ends the job, naming the rank
    let dir = scratch.0.join("no-restarts").display().to_string();
    let o = launch(
        &launcher,
        &fr,
        &[
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "0",
            &wine,
            "--checkpoint-dir",
            &dir,
        ],
        Some("tensor-parallel:500:1"),
    )?;
    let err = text(&o.stderr);
    let named = err.contains("rank 1 was killed by signal 9");
    println!(
        "test-resume: {} --max-restarts 0: exit {}, {}",
        if !o.status.success() && named {
            "ok  "
        } else {
            "FAIL"
        },
        o.status.code().unwrap_or(-1),
        if named {
            "names rank 1 killed by signal 9"
        } else {
            "does not name the killed rank"
        }
    );
    if o.status.success() || !named {
        failed.push(format!(
            "--max-restarts 0: exit {}\nstderr:\n{err}",
            o.status
        ));
    }
    // the GPT resumed at other world sizes, and an elastic job that shrinks
    failed.extend(crate::resume_gpt::gpt_cases(
        &launcher, &gpt, &scratch.0, &fr,
    )?);
    if failed.is_empty() {
        println!("test-resume: passed in {:.1}s", t0.elapsed().as_secs_f64());
        Ok(())
    } else {
        Err(format!("test-resume failed:\n{}", failed.join("\n")))
    }
}
