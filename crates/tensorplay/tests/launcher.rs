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
        .args(["--master-port", "29999", "sh", "-c"])
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

#[test]
fn ctrl_c_is_forwarded_to_every_rank() {
    let mut child = launcher()
        .args(["--nproc-per-node", "2", "sh", "-c"])
        .arg("trap 'echo interrupted $RANK; exit 0' INT; echo ready; while true; do sleep 0.05; done")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starts");
    // let both ranks install their trap
    std::thread::sleep(Duration::from_millis(800));
    let pid = libc::pid_t::try_from(child.id()).expect("pid");
    // SAFETY: sending SIGINT to the launcher we started.
    unsafe {
        libc::kill(pid, libc::SIGINT);
    }
    let t0 = Instant::now();
    let out = loop {
        if let Some(_s) = child.try_wait().expect("wait") {
            break child.wait_with_output().expect("output");
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "launcher did not stop"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("[rank 0] interrupted 0"), "{text}");
    assert!(text.contains("[rank 1] interrupted 1"), "{text}");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("interrupted"));
}
