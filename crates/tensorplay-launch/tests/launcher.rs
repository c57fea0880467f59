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

/// Ranks that fail with errors of their own: the first is the root, the other "also failed on
/// its own", never a consequence; a rank that reports a lost peer is a consequence. Rank 0
/// fails at once, rank 1 0.3 s later.
#[test]
fn ranks_that_fail_on_their_own_are_not_consequences() {
    // (case, what rank 1 does, the line that must follow the root's report)
    let cases = [
        (
            "two own errors",
            "echo rank-one-own-error >&2; exit 4",
            "\nalso failed on its own: rank 1 exited with code 4 (rank-one-own-error)",
        ),
        (
            "an own error and a lost peer",
            "echo 'connection to rank 0 failed during all_reduce: closed' >&2; exit 1",
            "\nthen, as a consequence: rank 1 exited with code 1 (connection to rank 0 failed",
        ),
    ];
    for (case, rank1, then) in cases {
        let out = launcher()
            .args(["--nproc-per-node", "2", "sh", "-c"])
            .arg(format!(
                "if [ $RANK = 0 ]; then echo rank-zero-own-error >&2; exit 3; fi; sleep 0.3; {rank1}"
            ))
            .output()
            .expect("runs");
        assert!(!out.status.success(), "{case}");
        let err = String::from_utf8_lossy(&out.stderr);
        let root = "rank 0 exited with code 3 (the first rank to fail); its last lines:\n    \
                    rank-zero-own-error";
        assert!(err.contains(&format!("{root}{then}")), "{case}: {err}");
        let labels = ["also failed", "as a consequence"];
        let count = labels.iter().filter(|l| err.contains(*l)).count();
        assert_eq!(count, 1, "{case}: one label only: {err}");
    }
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

/// One launcher command line: the lines its ranks print (sorted), or the exit status and the
/// words of its refusal.
struct ArgsCase {
    name: &'static str,
    args: Vec<String>,
    want: Result<Vec<String>, (i32, &'static str)>,
}

fn check_args(case: &ArgsCase) {
    let out = launcher()
        .args(&case.args)
        .env_remove("SLURM_PROCID")
        .env_remove("OMPI_COMM_WORLD_SIZE")
        .output()
        .expect("runs");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    match &case.want {
        Ok(want) => {
            assert!(out.status.success(), "{}: {out:?}", case.name);
            let mut lines: Vec<&str> = stdout.lines().collect();
            lines.sort_unstable();
            assert_eq!(lines, *want, "{}", case.name);
        }
        Err((code, says)) => {
            assert_eq!(out.status.code(), Some(*code), "{}: {stderr}", case.name);
            assert!(stderr.contains(says), "{}: {stderr}", case.name);
            // refused before any rank started
            assert_eq!(stdout, "", "{}", case.name);
            assert!(!stderr.contains("[rank"), "{}: {stderr}", case.name);
        }
    }
}

/// torchrun's spellings are aliases; an unknown flag before the program is refused with the
/// closest flag (not run as the program); flags after the program are the program's.
#[test]
fn torchrun_spellings_unknown_flags_and_the_program_s_flags() {
    let port = free_port().to_string();
    let v = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let env = "echo $RANK $WORLD_SIZE $LOCAL_RANK $MASTER_ADDR $MASTER_PORT";
    let cases = [
        ArgsCase {
            name: "torchrun's spellings with separate values",
            args: v(&[
                "--nproc_per_node",
                "2",
                "--nnodes",
                "2",
                "--node_rank",
                "1",
                "--master_addr",
                "127.0.0.1",
                "--master_port",
                &port,
                "--max_restarts",
                "0",
                "sh",
                "-c",
                env,
            ]),
            want: Ok(vec![
                format!("[rank 2] 2 4 0 127.0.0.1 {port}"),
                format!("[rank 3] 3 4 1 127.0.0.1 {port}"),
            ]),
        },
        ArgsCase {
            name: "torchrun's spellings with =",
            args: v(&[
                "--nproc_per_node=2",
                "--nnodes=2",
                "--node_rank=0",
                &format!("--rdzv_endpoint=127.0.0.1:{port}"),
                "sh",
                "-c",
                env,
            ]),
            want: Ok(vec![
                format!("[rank 0] 0 4 0 127.0.0.1 {port}"),
                format!("[rank 1] 1 4 1 127.0.0.1 {port}"),
            ]),
        },
        ArgsCase {
            name: "--standalone: one node on a local port",
            args: v(&[
                "--standalone",
                "--nnodes=1",
                "--nproc_per_node=2",
                "sh",
                "-c",
                "echo $RANK $WORLD_SIZE $MASTER_ADDR",
            ]),
            want: Ok(vec![
                "[rank 0] 0 2 127.0.0.1".into(),
                "[rank 1] 1 2 127.0.0.1".into(),
            ]),
        },
        ArgsCase {
            name: "the launcher's flags after the program are the program's",
            args: v(&[
                "sh",
                "-c",
                "echo \"$WORLD_SIZE $*\"",
                "x",
                "--nproc-per-node",
                "3",
                "--bogus",
                "--",
                "-v",
            ]),
            want: Ok(vec!["[rank 0] 1 --nproc-per-node 3 --bogus -- -v".into()]),
        },
        ArgsCase {
            name: "-- ends the launcher's flags",
            args: v(&["--nproc-per-node", "2", "--", "sh", "-c", "echo $RANK"]),
            want: Ok(vec!["[rank 0] 0".into(), "[rank 1] 1".into()]),
        },
        ArgsCase {
            name: "a misspelt flag is refused with the closest one",
            args: v(&["--nproc-per-nodes", "2", "true"]),
            want: Err((2, "tip: a similar argument exists: '--nproc-per-node'")),
        },
        ArgsCase {
            name: "a misspelt torchrun flag is refused with the closest one",
            args: v(&["--master_adr", "127.0.0.1", "true"]),
            want: Err((2, "tip: a similar argument exists: '--master_addr'")),
        },
        ArgsCase {
            name: "an unknown flag is refused, never run as the program",
            args: v(&["--nprocs", "2", "true"]),
            want: Err((2, "unexpected argument '--nprocs' found")),
        },
        ArgsCase {
            name: "a bad value is refused by clap",
            args: v(&["--nproc_per_node", "two", "true"]),
            want: Err((2, "invalid value 'two' for '--nproc-per-node <N>'")),
        },
        ArgsCase {
            name: "--standalone places the node itself",
            args: v(&["--standalone", "--rdzv_endpoint", "127.0.0.1:29400", "true"]),
            want: Err((2, "'--standalone' cannot be used with")),
        },
        ArgsCase {
            name: "--standalone is one node",
            args: v(&["--standalone", "--nnodes", "2", "true"]),
            want: Err((1, "--standalone runs a single-node job")),
        },
    ];
    for case in &cases {
        check_args(case);
    }
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

/// A folder of a test's own under the temp dir, removed when dropped.
struct TempDir(std::path::PathBuf);

impl TempDir {
    fn new(name: &str) -> TempDir {
        let d = std::env::temp_dir().join(format!("tp-launcher-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).expect("temp dir");
        TempDir(d)
    }

    /// The folder as a string for a child's shell script.
    fn sh(&self) -> String {
        self.0.display().to_string()
    }

    /// Waits until the file `name` appears in the folder.
    fn await_file(&self, name: &str, limit: Duration) {
        let t0 = Instant::now();
        while !self.0.join(name).exists() {
            assert!(t0.elapsed() < limit, "{name} did not appear in {limit:?}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A port free on 127.0.0.1 right now (for the launchers' rendezvous store).
/// A port for the launchers' store, below the ephemeral range: a port from `bind(0)` can be
/// taken by any outgoing connection of a parallel test before the first launcher binds it,
/// which left both launchers waiting as clients of a store nobody hosted.
fn free_port() -> u16 {
    tensorplay_collectives::rendezvous::free_port().expect("free port")
}

/// Waits until something listens on 127.0.0.1:`port`.
fn await_listener(port: u16, limit: Duration) {
    let t0 = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(t0.elapsed() < limit, "nothing listens on {port}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A launcher started in the background, its output collected by a thread; SIGKILLed when
/// dropped before [`Background::finish`].
struct Background {
    pid: libc::pid_t,
    out: Option<std::thread::JoinHandle<std::process::Output>>,
}

impl Background {
    fn start(cmd: &mut Command) -> Background {
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("starts");
        let pid = libc::pid_t::try_from(child.id()).expect("pid");
        let out = std::thread::spawn(move || child.wait_with_output().expect("output"));
        Background {
            pid,
            out: Some(out),
        }
    }

    fn kill(&self) {
        // SAFETY: signals the launcher we started (reaped only by our own thread).
        unsafe {
            libc::kill(self.pid, libc::SIGKILL);
        }
    }

    /// The output, once the launcher ended (killed after `limit`: a failed test).
    fn finish(mut self, limit: Duration) -> std::process::Output {
        let h = self.out.take().expect("not finished yet");
        let t0 = Instant::now();
        while !h.is_finished() {
            if t0.elapsed() > limit {
                self.kill();
                let out = h.join().expect("output");
                panic!("the launcher did not end within {limit:?}: {out:?}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        h.join().expect("output")
    }
}

impl Drop for Background {
    fn drop(&mut self) {
        if self.out.is_some() {
            self.kill();
        }
    }
}

/// `[rank R] env R K K' MAX PORT` lines of the restart tests: (rank, restarts, port).
fn env_lines(text: &str) -> Vec<(u32, u32, u16)> {
    text.lines()
        .filter_map(|l| {
            let w: Vec<&str> = l.split_whitespace().collect();
            (w.len() == 8 && w[2] == "env").then_some(())?;
            // both restart counts are the same
            assert_eq!(w[4], w[5], "{l}");
            Some((w[3].parse().ok()?, w[4].parse().ok()?, w[7].parse().ok()?))
        })
        .collect()
}

/// A rank failing in round 0 and succeeding in round 1 under `--max-restarts 2`: the whole
/// local group runs again with `TENSORPLAY_RESTART_COUNT`/`TORCHELASTIC_RESTART_COUNT` 1 and a
/// new `MASTER_PORT`, and the launcher succeeds.
#[test]
fn a_failed_round_restarts_with_a_new_port() {
    let out = launcher()
        .args(["--nproc-per-node", "2", "--max-restarts", "2", "sh", "-c"])
        .arg(
            "echo env $RANK $TENSORPLAY_RESTART_COUNT $TORCHELASTIC_RESTART_COUNT \
             $TORCHELASTIC_MAX_RESTARTS $MASTER_PORT; \
             if [ $RANK = 1 ] && [ $TENSORPLAY_RESTART_COUNT = 0 ]; then echo broken >&2; exit 3; fi",
        )
        .output()
        .expect("runs");
    let text = String::from_utf8_lossy(&out.stdout);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{text}{err}");
    let mut lines = env_lines(&text);
    lines.sort_unstable();
    assert_eq!(
        lines.iter().map(|l| (l.0, l.1)).collect::<Vec<_>>(),
        [(0, 0), (0, 1), (1, 0), (1, 1)],
        "{text}"
    );
    assert!(
        text.contains(" env 0 0 0 2 "),
        "TORCHELASTIC_MAX_RESTARTS: {text}"
    );
    let port = |round: u32| {
        let ports: Vec<u16> = lines.iter().filter(|l| l.1 == round).map(|l| l.2).collect();
        assert_eq!(ports[0], ports[1], "one port per round: {text}");
        ports[0]
    };
    assert_ne!(port(0), port(1), "round 1 has a new MASTER_PORT: {text}");
    assert!(
        err.contains("tensorplay-run: round 0 failed (restart 1 of 2): rank 1 exited with code 3"),
        "{err}"
    );
    assert!(!err.contains("round 1 failed"), "{err}");
}

/// A rank that always fails: three rounds under `--max-restarts 2`, then an error naming the
/// failure of each round.
#[test]
fn restarts_run_out_and_every_failure_is_named() {
    let out = launcher()
        .args(["--max-restarts", "2", "sh", "-c"])
        .arg("echo try $TENSORPLAY_RESTART_COUNT >&2; exit 3")
        .output()
        .expect("runs");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("round 2 failed and no restarts are left (--max-restarts 2)"),
        "{err}"
    );
    assert!(err.contains("every failure (3):"), "{err}");
    for r in 0..3 {
        assert!(
            err.contains(&format!(
                "  round {r}: rank 0 exited with code 3 (the first rank to fail): try {r}"
            )),
            "round {r}: {err}"
        );
    }
    for k in 1..=2 {
        assert!(
            err.contains(&format!("(restart {k} of 2)")),
            "restart {k}: {err}"
        );
    }
}

/// Without `--max-restarts` the first failure ends the job, as before restarts existed.
#[test]
fn no_restart_by_default() {
    let out = launcher()
        .args(["sh", "-c", "echo ran $TENSORPLAY_RESTART_COUNT; exit 3"])
        .output()
        .expect("runs");
    assert_eq!(out.status.code(), Some(1));
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        text.lines().collect::<Vec<_>>(),
        ["[rank 0] ran 0"],
        "{text}"
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.starts_with("tensorplay-run: rank 0 exited with code 3 (the first rank to fail)"),
        "{err}"
    );
    assert!(!err.contains("restart") && !err.contains("round"), "{err}");
}

/// Ctrl-C (here SIGTERM) never restarts the group, whatever `--max-restarts` says.
#[test]
fn an_interrupt_never_restarts() {
    let dir = TempDir::new("interrupt");
    let mut child = launcher()
        .args(["--max-restarts", "3", "sh", "-c"])
        .arg(format!(
            "echo ran $TENSORPLAY_RESTART_COUNT; touch {}/up; \
             i=0; while [ $i -lt 600 ]; do sleep 0.05; i=$((i+1)); done",
            dir.sh()
        ))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starts");
    dir.await_file("up", Duration::from_secs(20));
    let pid = libc::pid_t::try_from(child.id()).expect("pid");
    // SAFETY: signals the launcher we started.
    unsafe {
        libc::kill(pid, libc::SIGTERM);
    }
    let t0 = Instant::now();
    while child.try_wait().expect("wait").is_none() {
        assert!(t0.elapsed() < Duration::from_secs(20), "did not stop");
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().expect("output");
    assert!(!out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        text.lines().collect::<Vec<_>>(),
        ["[rank 0] ran 0"],
        "{text}"
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("interrupted"), "{err}");
    assert!(!err.contains("restart 1"), "{err}");
}

/// Bad `--nnodes` specs (and `--node-rank` with an elastic one) are refused naming the flag
/// and what it takes.
#[test]
fn bad_nnodes_specs_are_refused() {
    for (spec, why) in [
        ("3:2", "MIN (3) is larger than MAX (2)"),
        ("0:2", "MIN must be at least 1"),
        ("a:b", "expected N or MIN:MAX"),
        ("2:", "expected N or MIN:MAX"),
        ("two", "expected N or MIN:MAX"),
    ] {
        let out = launcher()
            .args(["--nnodes", spec, "true"])
            .output()
            .expect("runs");
        assert_eq!(out.status.code(), Some(1), "{spec}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains(&format!("--nnodes {spec:?}")) && err.contains(why),
            "{spec}: {err}"
        );
    }
    let out = launcher()
        .args(["--nnodes", "1:2", "--node-rank", "1", "true"])
        .output()
        .expect("runs");
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--node-rank is not used with an elastic"),
        "{err}"
    );
    let out = launcher()
        .args(["--rdzv-timeout", "0", "true"])
        .output()
        .expect("runs");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--rdzv-timeout 0: expected more than 0"),
        "{out:?}"
    );
    for (flags, want) in [
        (
            &["--rdzv-timeout", "inf"][..],
            "--rdzv-timeout inf: expected at most 86400",
        ),
        (
            &[
                "--nnodes",
                "1:2",
                "--rdzv-timeout",
                "5",
                "--rdzv-last-call",
                "6",
            ][..],
            "--rdzv-last-call 6 must be shorter than --rdzv-timeout 5",
        ),
    ] {
        let out = launcher().args(flags).arg("true").output().expect("runs");
        assert_eq!(out.status.code(), Some(1), "{flags:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(want), "{flags:?}: {err}");
    }
}

/// `(MASTER_ADDR:MASTER_PORT)` of the lines `[rank R] <tag> ... master M` of `rank` in
/// `restarts`.
fn master_of(text: &str, rank: u32, restarts: u32) -> String {
    let want = format!("[rank {rank}] restarts {restarts} ");
    text.lines()
        .find(|l| l.starts_with(&want))
        .and_then(|l| l.rsplit(' ').next())
        .unwrap_or_else(|| panic!("no {want:?} in {text}"))
        .to_string()
}

/// Two launchers of a two-node job with `--max-restarts 1`: a rank of node 1 fails once, and
/// both nodes restart together (node 0's running rank is stopped) and succeed.
#[test]
fn two_nodes_restart_together() {
    let port = free_port().to_string();
    let node =
        |rank: &str| {
            let mut c = launcher();
            c.args(["--nnodes", "2", "--node-rank", rank, "--max-restarts", "1"])
            .args(["--master-addr", "127.0.0.1", "--master-port", &port, "sh", "-c"])
            .arg(
                "echo restarts $TENSORPLAY_RESTART_COUNT $TORCHELASTIC_RESTART_COUNT rank $RANK \
                 of $WORLD_SIZE group $GROUP_RANK master $MASTER_ADDR:$MASTER_PORT; \
                 if [ $TENSORPLAY_RESTART_COUNT = 0 ]; then \
                   if [ $GROUP_RANK = 1 ]; then echo broken >&2; exit 4; fi; \
                   i=0; while [ $i -lt 600 ]; do sleep 0.05; i=$((i+1)); done; exit 9; \
                 fi",
            );
            c
        };
    let t0 = Instant::now();
    let n0 = Background::start(&mut node("0"));
    let n1 = Background::start(&mut node("1"));
    let (o0, o1) = (
        n0.finish(Duration::from_secs(40)),
        n1.finish(Duration::from_secs(40)),
    );
    let (t0_out, t1_out) = (
        String::from_utf8_lossy(&o0.stdout),
        String::from_utf8_lossy(&o1.stdout),
    );
    let (e0, e1) = (
        String::from_utf8_lossy(&o0.stderr),
        String::from_utf8_lossy(&o1.stderr),
    );
    assert!(o0.status.success(), "node 0: {t0_out}{e0}");
    assert!(o1.status.success(), "node 1: {t1_out}{e1}");
    assert!(
        t0_out.contains("[rank 0] restarts 0 0 rank 0 of 2 group 0 master 127.0.0.1:"),
        "{t0_out}"
    );
    assert!(
        t0_out.contains("[rank 0] restarts 1 1 rank 0 of 2 group 0 master 127.0.0.1:"),
        "{t0_out}"
    );
    assert!(
        t1_out.contains("[rank 1] restarts 1 1 rank 1 of 2 group 1 master 127.0.0.1:"),
        "{t1_out}"
    );
    // one children's master per round, on both nodes, never the launchers' store
    assert_eq!(master_of(&t0_out, 0, 1), master_of(&t1_out, 1, 1));
    assert_eq!(master_of(&t0_out, 0, 0), master_of(&t1_out, 1, 0));
    assert_ne!(master_of(&t0_out, 0, 0), master_of(&t0_out, 0, 1));
    assert!(!master_of(&t0_out, 0, 0).ends_with(&format!(":{port}")));
    assert!(
        e1.contains("round 0 failed (restart 1 of 1): rank 1 exited with code 4"),
        "{e1}"
    );
    assert!(e0.contains("ranks failed in round 0: restarting"), "{e0}");
    assert!(t0.elapsed() < Duration::from_secs(20), "{:?}", t0.elapsed());
}

/// The child script of the elastic tests: prints its place, then runs `then`.
fn elastic_node(port: &str, last_call: &str, script: &str) -> Command {
    let mut c = launcher();
    c.args(["--nnodes", "1:2", "--max-restarts", "1", "--rdzv-last-call", last_call])
        .args(["--master-addr", "127.0.0.1", "--master-port", port, "sh", "-c"])
        .arg(format!(
            "echo world $WORLD_SIZE rank $RANK group $GROUP_RANK restarts $TENSORPLAY_RESTART_COUNT; {script}"
        ));
    c
}

/// Elastic `--nnodes 1:2`: round 0 has both nodes; node 1's launcher is killed, node 0's rank
/// fails (its peer is gone), and node 0 restarts alone (WORLD_SIZE 1) and succeeds.
#[test]
fn elastic_job_goes_on_without_a_node_that_left() {
    let dir = TempDir::new("elastic-leave");
    let port = free_port().to_string();
    let d = dir.sh();
    let script = format!(
        "if [ $WORLD_SIZE = 2 ]; then touch {d}/up-$RANK; \
           i=0; while [ ! -f {d}/gone ] && [ $i -lt 600 ]; do sleep 0.05; i=$((i+1)); done; \
           echo peer lost >&2; exit 5; \
         fi"
    );
    let n0 = Background::start(&mut elastic_node(&port, "2", &script));
    // node 0 hosts the store (and so gets node rank 0)
    await_listener(port.parse().expect("port"), Duration::from_secs(20));
    let n1 = Background::start(&mut elastic_node(&port, "2", &script));
    dir.await_file("up-0", Duration::from_secs(20));
    dir.await_file("up-1", Duration::from_secs(20));
    n1.kill();
    std::fs::write(dir.0.join("gone"), b"").expect("marker");
    let t0 = Instant::now();
    let o0 = n0.finish(Duration::from_secs(40));
    let _ = n1.finish(Duration::from_secs(20));
    let text = String::from_utf8_lossy(&o0.stdout);
    let err = String::from_utf8_lossy(&o0.stderr);
    assert!(o0.status.success(), "{text}{err}");
    assert!(
        text.contains("[rank 0] world 2 rank 0 group 0 restarts 0"),
        "{text}"
    );
    assert!(
        text.contains("[rank 0] world 1 rank 0 group 0 restarts 1"),
        "{text}"
    );
    assert!(
        err.contains("round 0 failed (restart 1 of 1): rank 0 exited with code 5"),
        "{err}"
    );
    assert!(t0.elapsed() < Duration::from_secs(20), "{:?}", t0.elapsed());
}

/// Elastic `--nnodes 1:2`: node 0 runs alone; a second launcher arrives, waits, and node 0
/// restarts its group into a round with both (a membership change: the restart count stays 0).
#[test]
fn elastic_job_takes_in_a_node_that_arrives() {
    let dir = TempDir::new("elastic-join");
    let port = free_port().to_string();
    let d = dir.sh();
    let script = format!(
        "if [ $WORLD_SIZE = 1 ]; then touch {d}/alone; \
           i=0; while [ $i -lt 600 ]; do sleep 0.05; i=$((i+1)); done; exit 9; \
         fi"
    );
    let n0 = Background::start(&mut elastic_node(&port, "0.3", &script));
    dir.await_file("alone", Duration::from_secs(20));
    let t0 = Instant::now();
    let n1 = Background::start(&mut elastic_node(&port, "0.3", &script));
    let o1 = n1.finish(Duration::from_secs(40));
    let o0 = n0.finish(Duration::from_secs(20));
    let (text0, text1) = (
        String::from_utf8_lossy(&o0.stdout),
        String::from_utf8_lossy(&o1.stdout),
    );
    let (err0, err1) = (
        String::from_utf8_lossy(&o0.stderr),
        String::from_utf8_lossy(&o1.stderr),
    );
    assert!(o0.status.success(), "node 0: {text0}{err0}");
    assert!(o1.status.success(), "node 1: {text1}{err1}");
    assert!(
        text0.contains("[rank 0] world 1 rank 0 group 0 restarts 0"),
        "{text0}"
    );
    assert!(
        text0.contains("[rank 0] world 2 rank 0 group 0 restarts 0"),
        "{text0}"
    );
    assert_eq!(
        text1.lines().collect::<Vec<_>>(),
        ["[rank 1] world 2 rank 1 group 1 restarts 0"],
        "{text1}"
    );
    assert!(err0.contains("membership change"), "{err0}");
    assert!(!err0.contains("failed"), "{err0}");
    assert!(t0.elapsed() < Duration::from_secs(20), "{:?}", t0.elapsed());
}

/// What a rank started (a wrapper script's program) is stopped with it: a failed round leaves
/// no process behind, with or without restarts.
#[test]
fn a_failed_round_leaves_no_grandchild_behind() {
    let dir = TempDir::new("grandchildren");
    let out = launcher()
        .args([
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "1",
            "--kill-grace",
            "1",
        ])
        .args(["sh", "-c"])
        .arg(format!(
            "sleep 60 & echo $! >> {}/pids; if [ $RANK = 1 ]; then exit 3; fi; wait",
            dir.0.display()
        ))
        .output()
        .expect("runs");
    assert!(!out.status.success(), "{out:?}");
    let pids = std::fs::read_to_string(dir.0.join("pids")).expect("the ranks wrote their pids");
    let pids: Vec<&str> = pids.split_whitespace().collect();
    assert_eq!(pids.len(), 4, "2 ranks x 2 rounds: {pids:?}");
    // the kernel reaps the orphans' zombies: give it a moment
    let t0 = Instant::now();
    let alive = |p: &str| std::path::Path::new(&format!("/proc/{p}")).exists();
    while pids.iter().any(|p| alive(p)) && t0.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(50));
    }
    let left: Vec<&str> = pids.iter().copied().filter(|p| alive(p)).collect();
    assert!(left.is_empty(), "still running: {left:?}");
}

/// Launchers of one job with different `--nproc-per-node` are refused (their ranks would
/// clash or never exist): the second says which flags differ, and no rank runs.
#[test]
fn launchers_with_other_flags_are_refused() {
    let port = free_port().to_string();
    let node = |rank: &str, nproc: &str| {
        let mut c = launcher();
        c.args(["--nnodes", "2", "--node-rank", rank, "--max-restarts", "1"])
            .args(["--nproc-per-node", nproc, "--rdzv-timeout", "3"])
            .args(["--master-addr", "127.0.0.1", "--master-port", &port])
            .args(["sh", "-c", "echo ran $RANK of $WORLD_SIZE"]);
        c
    };
    let n0 = Background::start(&mut node("0", "1"));
    std::thread::sleep(Duration::from_millis(300));
    let o1 = node("1", "3").output().expect("runs");
    let o0 = n0.finish(Duration::from_secs(30));
    let e1 = String::from_utf8_lossy(&o1.stderr);
    assert!(!o1.status.success(), "{e1}");
    assert!(
        e1.contains("--nproc-per-node 3") && e1.contains("--nproc-per-node 1"),
        "{e1}"
    );
    assert!(!o0.status.success(), "node 0 cannot complete the job alone");
    let out = [o0.stdout, o1.stdout].concat();
    assert!(
        !String::from_utf8_lossy(&out).contains("ran "),
        "no rank may run"
    );
}
