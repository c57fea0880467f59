//! `tensorplay-run`: the environment each rank gets, output prefixes, a failing rank ending the
//! others with a message naming it, and Ctrl-C forwarded to every rank.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn launcher() -> Command {
    Command::new(env!("CARGO_BIN_EXE_tensorplay-run"))
}

#[test]
fn every_rank_gets_its_environment_and_a_prefix() {
    let out = launcher()
        .args(["--nproc-per-node", "3", "--node-rank", "1", "--nnodes", "2"])
        .args([
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            "29999",
            "sh",
            "-c",
        ])
        .arg("echo env $RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $MASTER_ADDR $MASTER_PORT")
        .output()
        .expect("runs");
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    let mut lines: Vec<&str> = text.lines().collect();
    lines.sort_unstable();
    assert_eq!(
        lines,
        [
            "[rank 3] env 3 6 0 3 127.0.0.1 29999",
            "[rank 4] env 4 6 1 3 127.0.0.1 29999",
            "[rank 5] env 5 6 2 3 127.0.0.1 29999",
        ]
    );
}

#[test]
fn a_failing_rank_ends_the_others_and_is_named() {
    let t0 = Instant::now();
    let out = launcher()
        .args(["--nproc-per-node", "3", "sh", "-c"])
        .arg("if [ $RANK = 2 ]; then echo broken >&2; exit 7; fi; sleep 60")
        .output()
        .expect("runs");
    assert!(!out.status.success());
    assert!(
        t0.elapsed() < Duration::from_secs(30),
        "the others were not stopped"
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("[rank 2] broken"), "{err}");
    assert!(
        err.contains("tensorplay-run: rank 2 exited with code 7"),
        "{err}"
    );
}

#[test]
fn bad_arguments_are_refused() {
    let out = launcher()
        .args(["--nnodes", "2", "--node-rank", "2", "true"])
        .output()
        .expect("runs");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--node-rank 2"));
    let out = launcher()
        .args(["--nnodes", "2", "true"])
        .output()
        .expect("runs");
    assert!(String::from_utf8_lossy(&out.stderr).contains("--master-port"));
    let out = launcher()
        .arg("/nonexistent/program")
        .output()
        .expect("runs");
    assert!(String::from_utf8_lossy(&out.stderr).contains("could not start rank 0"));
}

/// Ctrl-C, and the stop signals of schedulers and terminals (SIGTERM, SIGHUP), reach every rank
/// (as SIGINT) instead of leaving the ranks running without their launcher.
#[test]
fn ctrl_c_is_forwarded_to_every_rank() {
    for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        let mut child = launcher()
            .args(["--nproc-per-node", "2", "sh", "-c"])
            .arg(
                "trap 'echo interrupted $RANK; exit 0' INT; echo ready; \
                 while true; do sleep 0.05; done",
            )
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("starts");
        // let both ranks install their trap
        std::thread::sleep(Duration::from_millis(800));
        let pid = libc::pid_t::try_from(child.id()).expect("pid");
        // SAFETY: sending a signal to the launcher we started.
        unsafe {
            libc::kill(pid, sig);
        }
        let t0 = Instant::now();
        let out = loop {
            if let Some(_s) = child.try_wait().expect("wait") {
                break child.wait_with_output().expect("output");
            }
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "signal {sig}: launcher did not stop"
            );
            std::thread::sleep(Duration::from_millis(20));
        };
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            text.contains("[rank 0] interrupted 0"),
            "signal {sig}: {text}"
        );
        assert!(
            text.contains("[rank 1] interrupted 1"),
            "signal {sig}: {text}"
        );
        assert!(!out.status.success(), "signal {sig}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("interrupted"), "signal {sig}: {err}");
    }
}

/// Lines of stdout and stderr of two ranks, written to one file, stay whole.
#[test]
fn lines_of_both_streams_stay_whole() {
    let dir = std::env::temp_dir().join(format!("tp-launcher-lines-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let file = std::fs::File::create(dir.join("mixed.txt")).expect("file");
    let status = launcher()
        .args(["--nproc-per-node", "2", "sh", "-c"])
        .arg("i=0; while [ $i -lt 400 ]; do echo out $RANK $i; echo err $RANK $i >&2; i=$((i+1)); done")
        .stdout(file.try_clone().expect("clone"))
        .stderr(file)
        .status()
        .expect("runs");
    assert!(status.success());
    let text = std::fs::read_to_string(dir.join("mixed.txt")).expect("read");
    let _ = std::fs::remove_dir_all(&dir);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 1600, "{text}");
    for l in lines {
        let ok = [
            "[rank 0] out 0 ",
            "[rank 0] err 0 ",
            "[rank 1] out 1 ",
            "[rank 1] err 1 ",
        ]
        .iter()
        .any(|p| l.starts_with(p) && l[p.len()..].parse::<u32>().is_ok());
        assert!(ok, "mangled line {l:?}");
    }
}

/// Set by [`spawn_under_the_launcher_joins_its_job`] for the ranks it starts.
const SPAWN_CASE_ENV: &str = "TP_LAUNCHER_SPAWN_CASE";

/// Not a test of its own: the body each rank of [`spawn_under_the_launcher_joins_its_job`] runs
/// (it returns at once anywhere else).
#[test]
fn spawn_inside_the_launcher() {
    use tensorplay as tp;
    use tp::distributed as dist;
    let Ok(case) = std::env::var(SPAWN_CASE_ENV) else {
        return;
    };
    let n: usize = case.parse().expect("nprocs");
    let r = dist::spawn(n, |rank| {
        dist::init_process_group("cpu", Default::default())?;
        let x = tp::full(&[2], (rank + 1) as f64)?;
        dist::all_reduce(&x, dist::ReduceOp::Sum, None)?;
        let world = dist::get_world_size(None)?;
        println!(
            "joined rank {rank} of {world}: sum {:?}",
            x.to_vec::<f32>()?
        );
        dist::barrier(None)?;
        dist::destroy_process_group()?;
        Ok(())
    });
    // reached only when spawn refused (a joined rank exits inside spawn)
    eprintln!("spawn refused: {}", r.unwrap_err());
    std::process::exit(3);
}

/// A program calling `spawn(2, ..)` run as `tensorplay-run --nproc-per-node 2 program` is one job
/// of two ranks (not two jobs of two), and `spawn(3, ..)` there is refused naming both numbers.
#[test]
fn spawn_under_the_launcher_joins_its_job() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free port")
        .port();
    let exe = std::env::current_exe().expect("test binary");
    let run = |case: &str| {
        launcher()
            .args(["--nproc-per-node", "2", "--master-port", &port.to_string()])
            .arg(&exe)
            .args([
                "spawn_inside_the_launcher",
                "--exact",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(SPAWN_CASE_ENV, case)
            .env("TENSORPLAY_SPAWN_VERBOSE", "1")
            .stdin(Stdio::null())
            .output()
            .expect("runs")
    };
    let out = run("2");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    // "[rank R] <libtest's words> joined rank R of 2: ..." -> "[rank R] joined rank R of 2: ..."
    let mut joined: Vec<String> = text
        .lines()
        .filter_map(|l| {
            let at = l.find("joined rank")?;
            Some(format!("{} {}", &l[..l.find(']')? + 1], &l[at..]))
        })
        .collect();
    joined.sort_unstable();
    assert_eq!(
        joined,
        [
            "[rank 0] joined rank 0 of 2: sum [3.0, 3.0]",
            "[rank 1] joined rank 1 of 2: sum [3.0, 3.0]",
        ],
        "{text}"
    );
    assert!(
        !text.contains("[rank 0] [rank"),
        "a nested job was started: {text}"
    );

    let out = run("3");
    assert!(!out.status.success(), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("spawn refused"), "{err}");
    assert!(
        err.contains("nprocs") && err.contains('3') && err.contains("WORLD_SIZE"),
        "{err}"
    );
}

/// The GPU check never reports checks that did not run: without a driver or GPU it says why
/// and exits 2; with one it ends with `N passed, M failed, K skipped`.
#[test]
fn gpu_check_without_a_gpu_says_why_and_fails() {
    let out = Command::new(env!("CARGO_BIN_EXE_tensorplay-gpu-check"))
        .env("TENSORPLAY_SPAWN_VERBOSE", "0")
        .output()
        .expect("run tensorplay-gpu-check");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    if tensorplay::cuda::is_available() {
        assert!(
            stdout
                .lines()
                .any(|l| l.contains(" passed, ") && l.contains(" failed, ")),
            "{stdout}{stderr}"
        );
        return;
    }
    assert_eq!(out.status.code(), Some(2), "{stdout}{stderr}");
    assert!(stderr.contains("nothing was checked"), "{stderr}");
    assert!(!stdout.contains("passed"), "{stdout}");
}

/// Selects [`rank_killed_under_the_launcher`]'s body in the ranks the launcher starts.
const KILL_CASE_ENV: &str = "TP_LAUNCHER_KILL_CASE";

/// Not a test of its own: each rank of [`the_killed_rank_is_the_one_named`] runs this (it
/// returns at once anywhere else): rank 2 is SIGKILLed while the others wait for it.
#[test]
fn rank_killed_under_the_launcher() {
    use tensorplay as tp;
    use tp::distributed as dist;
    if std::env::var_os(KILL_CASE_ENV).is_none() {
        return;
    }
    let r = (|| -> tp::Result<()> {
        dist::init_process_group("cpu", Default::default())?;
        dist::barrier(None)?;
        if dist::get_rank(None)? == 2 {
            // SAFETY: signals this very process; nothing runs after it.
            unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
        }
        dist::all_reduce(&tp::ones(&[100])?, dist::ReduceOp::Sum, None)?;
        Ok(())
    })();
    if let Err(e) = r {
        eprintln!("{e}");
        std::process::exit(1);
    }
}

/// Under `tensorplay-run --nproc-per-node 3`, a rank killed by a signal is the one the launcher
/// names, never a survivor that failed a moment later reporting it (run many times: the
/// survivors end about a millisecond after it).
#[test]
fn the_killed_rank_is_the_one_named() {
    let exe = std::env::current_exe().expect("test binary");
    let fr = std::env::temp_dir().join(format!("tp-launcher-fr-{}", std::process::id()));
    for run in 0..20 {
        let _ = std::fs::remove_dir_all(&fr);
        let out = launcher()
            .args(["--nproc-per-node", "3", "--kill-grace", "2"])
            .arg(&exe)
            .args([
                "rank_killed_under_the_launcher",
                "--exact",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(KILL_CASE_ENV, "1")
            .env("TENSORPLAY_FR_DIR", &fr)
            .stdin(Stdio::null())
            .output()
            .expect("runs");
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("tensorplay-run: rank 2 was killed by signal 9 (the first rank to fail)"),
            "run {run}: {err}"
        );
        // the survivors' flight recorders, diagnosed by the launcher
        assert!(err.contains("flight recorder ("), "run {run}: {err}");
        assert!(err.contains("rank 2: no dump"), "run {run}: {err}");
    }
    // and by tensorplay-fr, from the folder
    let fr_bin = || Command::new(env!("CARGO_BIN_EXE_tensorplay-fr"));
    let out = fr_bin().arg(&fr).output().expect("runs tensorplay-fr");
    let text = String::from_utf8_lossy(&out.stdout);
    let _ = std::fs::remove_dir_all(&fr);
    assert!(out.status.success(), "{out:?}");
    assert!(text.contains("failed in #1 all_reduce"), "{text}");
    assert!(text.contains("launcher.rs:"), "the call site: {text}");
    let out = fr_bin().arg(&fr).output().expect("runs tensorplay-fr");
    assert!(!out.status.success(), "a folder without dumps is an error");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("cannot read"),
        "{out:?}"
    );
}
