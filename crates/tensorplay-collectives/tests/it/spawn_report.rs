//! What a user sees when a `spawn` job fails: a failing rank's message printed once live and
//! once in the error (each case runs a whole job, parent and children, as a separate process,
//! the way a program calling `spawn` from `main` runs, and reads everything it printed), and
//! which ranks the error calls consequences.

use std::time::Duration;

use tensorplay_collectives::spawn::is_spawned_child;
use tensorplay_collectives::{Error, SpawnOptions, spawn, spawn_with};

/// Set in the process that plays the user's program (the job's parent and, inherited, its
/// children): how rank 1 fails, `panic` or `error`.
const INNER: &str = "TP_SPAWN_REPORT_INNER";

const PANIC_TEXT: &str = "the-panic-message of rank one";
const ERROR_TEXT: &str = "the-error-message of rank one";

/// Runs the test `test` again in a fresh process with [`INNER`] set to `kind` and the extra
/// environment `env`, and returns what it printed (stdout then stderr).
fn run_as_program(test: &str, kind: &str, env: &[(&str, &str)]) -> String {
    let exe = std::env::current_exe().expect("the test binary");
    let out = std::process::Command::new(exe)
        .arg(tensorplay_testkit::test_name(module_path!(), test))
        .args(["--exact", "--nocapture", "--test-threads=1", "-q"])
        .env(INNER, kind)
        .env_remove("TENSORPLAY_SPAWN_VERBOSE")
        .env_remove("RUST_BACKTRACE")
        .envs(env.iter().copied())
        .output()
        .expect("runs the test binary");
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// A job of 2 ranks whose rank 1 panics or returns an error: the message is forwarded once
/// (`[rank 1] failed: ...`) and quoted once in the error, never repeated by the panic hook or
/// in the error's output; with `TENSORPLAY_SPAWN_VERBOSE=0` only the error has it.
#[test]
fn a_failing_rank_is_printed_once() {
    if let Ok(kind) = std::env::var(INNER) {
        // the user's program: `fn main() -> Result<..>` prints `Error: {err:?}`
        let err = spawn(2, |rank| {
            if rank == 1 {
                if kind == "panic" {
                    panic!("{PANIC_TEXT}");
                }
                return Err(ERROR_TEXT.into());
            }
            Ok(())
        })
        .expect_err("rank 1 fails");
        eprintln!("Error: {err:?}");
        return;
    }
    let here = concat!("panicked at ", file!(), ":");
    // (case, how rank 1 fails, environment, times its message is printed, texts that must be
    // in the output, texts that must not)
    type Case = (
        &'static str,
        &'static str,
        Vec<(&'static str, &'static str)>,
        usize,
        Vec<String>,
        Vec<&'static str>,
    );
    let cases: Vec<Case> = vec![
        (
            "a panic",
            "panic",
            vec![],
            2,
            vec![
                format!("[rank 1] failed: {here}"),
                format!("Error: spawn: rank 1 failed: {here}"),
                "[rank 1] note: run with `RUST_BACKTRACE=1`".into(),
            ],
            vec!["thread '", "tensorplay-spawn-error"],
        ),
        (
            "a panic with RUST_BACKTRACE=1",
            "panic",
            vec![("RUST_BACKTRACE", "1")],
            2,
            vec![
                format!("[rank 1] failed: {here}"),
                "[rank 1] stack backtrace:".into(),
            ],
            vec!["thread '", "tensorplay-spawn-error"],
        ),
        (
            "an error",
            "error",
            vec![],
            2,
            vec![
                format!("[rank 1] failed: {ERROR_TEXT}"),
                format!("Error: spawn: rank 1 failed: {ERROR_TEXT} (exited with code 1)"),
            ],
            vec!["tensorplay-spawn-error"],
        ),
        (
            "a panic, quiet",
            "panic",
            vec![("TENSORPLAY_SPAWN_VERBOSE", "0")],
            1,
            vec![format!("Error: spawn: rank 1 failed: {here}")],
            vec!["[rank 1] failed", "thread '", "tensorplay-spawn-error"],
        ),
    ];
    for (case, kind, env, times, present, absent) in cases {
        let seen = run_as_program("a_failing_rank_is_printed_once", kind, &env);
        let text = if kind == "panic" {
            PANIC_TEXT
        } else {
            ERROR_TEXT
        };
        assert_eq!(seen.matches(text).count(), times, "{case}: {seen}");
        for p in present {
            assert!(seen.contains(&p), "{case}: {p:?} missing in: {seen}");
        }
        for a in absent {
            assert!(!seen.contains(a), "{case}: {a:?} in: {seen}");
        }
    }
}

/// Ranks that fail with errors of their own are the root and "also failed on its own", never
/// a cause and its consequence; a rank whose message says it lost a peer is a consequence.
/// Rank 1 fails first; rank 0 300 ms later (`TP_OWN_CASE` picks what it says).
#[test]
fn ranks_that_fail_on_their_own_are_not_consequences() {
    let job = |rank: usize| -> Result<(), tensorplay_collectives::SpawnError> {
        if rank == 1 {
            return Err("rank one's own error".into());
        }
        std::thread::sleep(Duration::from_millis(300));
        Err(std::env::var("TP_OWN_CASE")?.into())
    };
    // (case, rank 0's message, the line that must follow the root's)
    let cases = [
        (
            "two own errors",
            "rank zero's own error",
            "\nalso failed on its own: rank 0 (rank zero's own error)",
        ),
        (
            "an own error and a lost peer",
            "connection to rank 1 failed during all_reduce: closed",
            "\nthen, as a consequence: rank 0 (connection to rank 1 failed",
        ),
    ];
    for (case, rank0_says, then) in cases {
        let opts = SpawnOptions {
            env: vec![("TP_OWN_CASE".into(), rank0_says.into())],
            ..SpawnOptions::new(2)
        };
        let r = spawn_with(opts, job);
        if is_spawned_child() {
            // the second case's children pass the first call (Ok there): parent-only check
            continue;
        }
        match r {
            Err(Error::Spawn { rank, reason, .. }) => {
                assert_eq!(rank, 1, "{case}: {reason}");
                let first = "failed: rank one's own error (exited with code 1)";
                assert!(
                    reason.starts_with(&format!("{first}{then}")),
                    "{case}: {reason}"
                );
                let labels = ["also failed", "as a consequence"];
                let count = labels.iter().filter(|l| reason.contains(*l)).count();
                assert_eq!(count, 1, "{case}: one label only: {reason}");
            }
            other => panic!("{case}: expected Spawn, got {other:?}"),
        }
    }
}
