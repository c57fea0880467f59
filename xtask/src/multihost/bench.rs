//! `cargo xtask bench-collectives --hosts K`: the `bench_collectives` table with its ranks
//! spread over K simulated hosts (TCP over the harness's veth links between hosts, shared
//! memory inside each), next to the same table on one host with the same number of ranks.
//!
//! The simulated links are veth pairs through a bridge inside one machine: a "network" transfer
//! is a copy through the kernel's TCP stack on the same cores, not a NIC. What the ratio shows
//! is what crossing hosts costs this stack (TCP framing, the hierarchical algorithms, the
//! kernel's copies) against same-host shared memory, not a real cluster's link speed.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use super::hosts::{Hosts, is_root};
use super::run::{MASTER_PORT, outputs, signal, start};
use crate::packages::LAUNCH_PACKAGE;

/// One line of `bench_collectives`: (collective, bytes) -> (us, busbw GB/s).
type Row = ((String, u64), (f64, f64));

fn parse(text: &str) -> Vec<Row> {
    text.lines()
        .filter_map(|l| {
            let l = l.split_once("] ").map_or(l, |(_, r)| r);
            let t: Vec<&str> = l.split_whitespace().collect();
            if t.len() < 12 || t[0] != "tensorplay-cpu" || t[3] != "B" || t[5] != "us" {
                return None;
            }
            Some((
                (t[1].to_string(), t[2].parse().ok()?),
                (t[4].parse().ok()?, t[10].parse().ok()?),
            ))
        })
        .collect()
}

fn release_executables() -> Result<(PathBuf, PathBuf), String> {
    let st = Command::new("cargo")
        .args(["build", "--release", "-q", "-p", "tensorplay-collectives"])
        .args(["--example", "bench_collectives", "-p", LAUNCH_PACKAGE])
        .args(["--bin", "tensorplay-run"])
        .status()
        .map_err(|e| format!("could not run cargo: {e}"))?;
    if !st.success() {
        return Err("building bench_collectives and tensorplay-run (release) failed".into());
    }
    let out = Command::new("cargo")
        .args(["metadata", "--format-version", "1", "--no-deps"])
        .output()
        .map_err(|e| format!("cargo metadata: {e}"))?;
    let text = String::from_utf8_lossy(&out.stdout);
    let key = "\"target_directory\":\"";
    let dir = text
        .find(key)
        .and_then(|i| {
            let rest = &text[i + key.len()..];
            rest.find('"').map(|j| PathBuf::from(&rest[..j]))
        })
        .ok_or("cargo metadata did not name the target directory")?;
    let release = dir.join("release");
    Ok((
        release.join("examples").join("bench_collectives"),
        release.join("tensorplay-run"),
    ))
}

/// Runs the table on one host (`spawn`), then on `hosts` simulated hosts x `per_host` ranks,
/// and prints both with the ratio of their bus bandwidths.
pub(crate) fn bench_hosts(hosts: usize, per_host: usize, max_mib: usize) -> Result<(), String> {
    if !is_root() {
        return Err("bench-collectives --hosts needs root: it creates network namespaces".into());
    }
    if hosts < 2 || per_host == 0 {
        return Err(format!(
            "--hosts must be at least 2 and --per-host at least 1 (got {hosts} and {per_host})"
        ));
    }
    let world = hosts * per_host;
    let (bench, launcher) = release_executables()?;
    eprintln!("one host, {world} ranks");
    let one = Command::new(&bench)
        .args([world.to_string(), max_mib.to_string()])
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| format!("running {}: {e}", bench.display()))?;
    if !one.status.success() {
        return Err("bench_collectives on one host failed".into());
    }
    let one = parse(&String::from_utf8_lossy(&one.stdout));
    eprintln!("{hosts} simulated hosts x {per_host} ranks");
    let many = {
        let net = Hosts::create(hosts)?;
        let mut launched = Vec::new();
        for h in 0..hosts {
            let cmd: Vec<String> = vec![
                launcher.display().to_string(),
                "--nnodes".into(),
                hosts.to_string(),
                "--node-rank".into(),
                h.to_string(),
                "--nproc-per-node".into(),
                per_host.to_string(),
                "--master-addr".into(),
                net.addr(0),
                "--master-port".into(),
                MASTER_PORT.to_string(),
                "--".into(),
                bench.display().to_string(),
                world.to_string(),
                max_mib.to_string(),
            ];
            let mut c = net.command(h, &cmd);
            c.stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            launched.push(start(c, h)?);
        }
        let deadline = Instant::now() + Duration::from_secs(1800);
        let mut ok = true;
        for l in &mut launched {
            loop {
                match l.child.try_wait() {
                    Ok(Some(st)) => {
                        ok &= st.success();
                        break;
                    }
                    Ok(None) if Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_millis(100));
                    }
                    _ => {
                        signal(&l.child, "-KILL");
                        let _ = l.child.wait();
                        ok = false;
                        break;
                    }
                }
            }
        }
        let outs = outputs(launched);
        if !ok {
            return Err(format!(
                "bench_collectives across hosts failed:\n{}",
                outs.join("\n")
            ));
        }
        parse(&outs[0])
    };
    println!(
        "busbw (GB/s), {world} ranks: one host (shared memory) vs {hosts} simulated hosts x {per_host} (TCP over veth between hosts)"
    );
    println!(
        "{:<15} {:>10}  {:>10} {:>10}  {:>9} {:>9} {:>7}",
        "collective", "bytes", "1host_us", "hosts_us", "1host", "hosts", "hosts/1"
    );
    for ((name, bytes), (us, bw)) in &many {
        match one.iter().find(|(k, _)| k.0 == *name && k.1 == *bytes) {
            Some((_, (us1, bw1))) => println!(
                "{name:<15} {bytes:>10}  {us1:>10.1} {us:>10.1}  {bw1:>9.3} {bw:>9.3} {:>7.3}",
                if *bw1 > 0.0 { bw / bw1 } else { f64::NAN }
            ),
            None => println!(
                "{name:<15} {bytes:>10}  {:>10} {us:>10.1}  {:>9} {bw:>9.3} {:>7}",
                "-", "-", "-"
            ),
        }
    }
    Ok(())
}
