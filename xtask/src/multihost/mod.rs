//! `cargo xtask test-multihost`: K simulated hosts on this machine, each a network namespace
//! with its own `/dev/shm` (a tmpfs mounted in its own mount namespace) and hostname (its own
//! UTS namespace), connected by veth pairs to a bridge that lives in a namespace of its own,
//! with addresses from a private range that exist only inside those namespaces. Nothing runs in
//! the root namespace's network and nothing is added to it: every job talks only over the
//! harness's own links.
//!
//! Each scenario starts `tensorplay-run --nnodes K --node-rank h` on every host `h` (the
//! launcher's ranks join the job through `spawn`, so the project's own multi-process tests run
//! unchanged with their ranks spread over the hosts), waits for all of them within a deadline,
//! and counts the scenario passed when every launcher exited 0. Everything is removed at the
//! end, also after a failure (the hosts are dropped on every path, and the job's processes are
//! stopped first); namespaces left by a run that was killed outright carry the name prefix and
//! are removed at the next start. Needs root (`ip netns`); without it the command says so and
//! fails.
//!
//! `hosts` makes the hosts and injects faults, `run` runs one scenario, `catalog` lists them,
//! `bench` runs `bench_collectives` across hosts (`cargo xtask bench-collectives --hosts K`).

mod bench;
mod catalog;
mod hosts;
mod run;

use std::process::Command;
use std::time::{Duration, Instant};

pub(crate) use bench::bench_hosts;
use catalog::scenarios;
pub(crate) use catalog::{executables, find};
use hosts::{Fault, Hosts, is_root, ours, remove_all};
use run::{RUNNING, run_scenario};

/// `cargo xtask test-multihost`.
pub(crate) fn test_multihost(filter: Option<&str>) -> Result<(), String> {
    if !is_root() {
        return Err(
            "test-multihost needs root: it creates network, mount and UTS namespaces (run it as root, as CI does)"
                .into(),
        );
    }
    // Ctrl-C, SIGTERM or SIGHUP: the jobs' launchers get the signal too (they stop their
    // ranks); the hosts go with them
    let _ = ctrlc::set_handler(|| {
        let pids: Vec<u32> = RUNNING.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let kill = |sig: &str| {
            for p in &pids {
                let _ = Command::new("kill").args([sig, &p.to_string()]).status();
            }
        };
        // the launchers pass it on to their ranks and wait for them
        kill("-TERM");
        std::thread::sleep(Duration::from_secs(3));
        kill("-KILL");
        remove_all();
        eprintln!("test-multihost: interrupted; the simulated hosts were removed");
        std::process::exit(130);
    });
    // `--workspace`, as `cargo test --workspace` builds them: the same features, so nothing
    // is compiled twice in CI
    let tests = executables(
        &[
            "test",
            "--workspace",
            "--no-run",
            "--test",
            "multiprocess",
            "--test",
            "it",
            "--test",
            "vectors",
        ],
        &["multiprocess", "tensorplay-rpc:it", "vectors"],
    )?;
    let bins = executables(
        &[
            "build",
            "--workspace",
            "--bin",
            "tensorplay-run",
            "--example",
            "wine_distributed",
            "--example",
            "fault_loop",
            "--example",
            "rpc_fault_loop",
        ],
        &[
            "tensorplay-run",
            "wine_distributed",
            "fault_loop",
            "rpc_fault_loop",
        ],
    )?;
    let launcher = &find(&bins, "tensorplay-run")?;
    let multiprocess = &find(&tests, "multiprocess")?;
    let conformance = &find(&tests, "vectors")?;
    let wine = &find(&bins, "wine_distributed")?;
    let fault_loop = &find(&bins, "fault_loop")?;
    let rpc_fault_loop = &find(&bins, "rpc_fault_loop")?;
    let rpc = &find(&tests, "tensorplay-rpc:it")?;
    let mut all = scenarios(
        multiprocess,
        conformance,
        rpc,
        wine,
        fault_loop,
        rpc_fault_loop,
    );
    if let Some(f) = filter {
        all.retain(|s| s.name.contains(f));
    }
    let (mut passed, mut failed) = (0, 0);
    for s in &all {
        let t0 = Instant::now();
        let r = Hosts::create(s.hosts).and_then(|hosts| run_scenario(&hosts, launcher, s));
        match r {
            Ok((ms, lines))
                if matches!(
                    s.fault,
                    Some(Fault::LinkDown(_) | Fault::KillHost(_) | Fault::Blackhole(_))
                ) =>
            {
                passed += 1;
                println!(
                    "ok     {} ({:.1} s; every launcher failed {:.1} s after the fault, the lost rank named)",
                    s.name,
                    t0.elapsed().as_secs_f64(),
                    ms.first().copied().unwrap_or(0) as f64 / 1000.0
                );
                for l in lines {
                    println!("         {l}");
                }
            }
            Ok((sent, _)) => {
                passed += 1;
                let kib: Vec<String> = sent.iter().map(|b| format!("{}", b / 1024)).collect();
                println!(
                    "ok     {} ({:.1} s; KiB sent across by each host: {})",
                    s.name,
                    t0.elapsed().as_secs_f64(),
                    kib.join(", ")
                );
            }
            Err(e) => {
                failed += 1;
                println!(
                    "FAILED {} ({:.1} s)\n{e}",
                    s.name,
                    t0.elapsed().as_secs_f64()
                );
            }
        }
    }
    remove_all();
    let left = ours();
    if !left.is_empty() {
        println!("error: namespaces left behind: {left:?}");
        failed += 1;
    }
    println!("{passed} passed, {failed} failed");
    if failed > 0 {
        return Err(format!("{failed} multi-host scenario(s) failed"));
    }
    Ok(())
}
